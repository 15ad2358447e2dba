"""A checkpoint that cannot be written or read is reported in one line that keeps its cause: the
OS's reason however long orbax's message, and the damaged file's name where orbax's error gives
only a JSON parser's column (logra_jax/checkpoint.py)."""

import logging
import os
import sys
import types

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


def _two_checkpoints(folder):
    saver = checkpoint.Checkpointer(folder)
    state = {"w": jax.numpy.arange(4096.0), "v": jax.numpy.ones((64, 64))}
    saver.save(1, state, {"step": 1})
    saver.save(2, state, {"step": 2})
    return saver, state


def test_a_damaged_checkpoints_reason_survives_tensorstores_spec(tmp_path, caplog):
    """Tensorstore follows its reason with two copies of the store's JSON spec (~1,500
    characters): the warning keeps the reason whole and leaves the spec out (cutting the middle of
    the whole text cut the reason: "Error reading Byte range [0, 290 … ")."""
    saver, state = _two_checkpoints(tmp_path / "checkpoints")
    [torn] = (tmp_path / "checkpoints" / "2" / "state" / "d").iterdir()   # the arrays' zarr metadata
    size = torn.stat().st_size
    torn.write_bytes(torn.read_bytes()[: size // 2])
    with caplog.at_level(logging.WARNING):
        step, _, _ = saver.restore_latest(state)
    assert step == 1
    [record] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    message = record.getMessage()
    assert (f"Requested byte range [0, {size}) is not valid for value of size {size // 2}"
            in message and "tensorstore_spec" not in message), message
    saver.close()


def test_the_only_checkpoint_torn_is_one_error_naming_its_file(tmp_path, monkeypatch):
    """Its arrays' metadata cut short: the error names that file, and the reads orbax abandons
    when a restore fails ("Event loop is closed", once each, whenever they end) are not reported;
    another unraisable report still is."""
    saver, state = _two_checkpoints(tmp_path / "checkpoints")
    saver.close()
    import shutil
    shutil.rmtree(tmp_path / "checkpoints" / "1")
    [torn] = (tmp_path / "checkpoints" / "2" / "state" / "array_metadatas").iterdir()
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    reports = []
    monkeypatch.setattr(sys, "unraisablehook", reports.append)
    saver = checkpoint.Checkpointer(tmp_path / "checkpoints")
    with pytest.raises(ValueError, match=f"newest: step 2: {torn} is not valid JSON: ") as refused:
        saver.restore_latest(state)
    # A torn only checkpoint: the damaged file named, and --fresh said first (the config did not
    # change; the advice used to be about a changed config alone).
    assert "it is the only one): where a file is damaged, pass --fresh" in str(refused.value)
    [other] = (tmp_path / "checkpoints" / "2" / "state" / "d").iterdir()   # a failure inside orbax
    other.write_bytes(b"")
    (tmp_path / "checkpoints" / "2" / "state" / "array_metadatas" / torn.name).unlink()
    with pytest.raises(ValueError, match="no checkpoint .* can be restored"):
        saver.restore_latest(state)
    saver.close()

    def report(error):
        return types.SimpleNamespace(exc_type=type(error), exc_value=error, exc_traceback=None,
                                     err_msg=None, object=None)
    sys.unraisablehook(report(RuntimeError("Event loop is closed")))
    sys.unraisablehook(report(RuntimeError("something else")))
    assert [str(r.exc_value) for r in reports] == ["something else"]
