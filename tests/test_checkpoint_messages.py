"""A checkpoint that cannot be written or read is reported in one line that keeps its cause: the
OS's reason however long orbax's message, and the damaged file's name where orbax's error gives
only a JSON parser's column (logra_jax/checkpoint.py)."""

import logging
import os

import jax
import pytest

from logra_jax import checkpoint


def test_a_failed_write_keeps_the_os_reason_however_long_the_message(tmp_path, monkeypatch):
    """Orbax wraps tensorstore's error in one whose text is a page of TensorStore spec, and
    tensorstore puts the OS's reason mid-message, before its source locations: shortening the text
    in the middle lost "File too large"."""
    saver = checkpoint.Checkpointer(tmp_path / "checkpoints")
    inner = ValueError(
        'OUT_OF_RANGE: Error writing "w/0.0" in OCDBT database at local file "' + "/d" * 150
        + '": Failed to write 869394 bytes to file 14: File too large [os_error_code=\'27\'] '
        "[source locations='" + "tensorstore/kvstore/file/file_key_value_store.cc:123\n" * 8 + "']")

    def fail(*args, **kwargs):
        try:
            raise inner
        except ValueError as e:
            raise Exception("Encountered error while writing array. See full TensorStore "
                            "details: " + "'driver': 'zarr', " * 100) from e
    monkeypatch.setattr(saver._manager, "save", fail)
    with pytest.raises(OSError) as raised:
        saver.save(3, {"w": jax.numpy.zeros(2)}, {"step": 3})
    message = str(raised.value)
    assert message.startswith(f"checkpoint 3 could not be written to {tmp_path / 'checkpoints'}: "
                              f"{os.strerror(27)} (OUT_OF_RANGE: Error writing \"w/0.0\""), message
    assert len(message) < 600
    saver.close()


def test_a_damaged_checkpoint_is_named_by_its_file(tmp_path, caplog):
    """A JSON metadata file cut short: orbax's error is "Expecting value: line 1 column N"; the
    warning that sets the checkpoint aside names the file, and nothing else is logged."""
    folder = tmp_path / "checkpoints"
    saver = checkpoint.Checkpointer(folder)
    state = {"w": jax.numpy.arange(8.0)}
    saver.save(1, state, {"step": 1})
    saver.save(2, state, {"step": 2})
    torn = folder / "2" / "state" / "_METADATA"
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    with caplog.at_level(logging.INFO):
        step, _, meta = saver.restore_latest(state)
    assert (step, meta["step"]) == (1, 1)
    [record] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert f"checkpoint 2 cannot be restored ({torn} is not valid JSON: Expecting" in \
        record.getMessage(), record.getMessage()
    saver.close()
