"""PromptIterator: epoch-wise permutations, batches across epoch ends, exact resume from state()."""

import json

import numpy as np
import pytest

from logra_jax.data import PromptIterator


class Numbered:
    """A source whose example i says i, so orders can be read back."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"question": f"q{i}", "answer": str(i)}


def ids(batch):
    return [int(e["answer"]) for e in batch]


def test_each_epoch_is_the_seeded_permutation_and_batches_cross_epochs():
    n, batch_size = 10, 4
    it = PromptIterator(Numbered(n), batch_size=batch_size, seed=5)
    drawn = [i for _ in range(5) for i in ids(it.next())]  # 20 = exactly two epochs
    for epoch in (0, 1):
        want = np.random.default_rng([5, epoch]).permutation(n).tolist()
        assert drawn[epoch * n:(epoch + 1) * n] == want
    assert drawn[:n] != drawn[n:]
    assert it.state() == {"epoch": 1, "position": n}


def test_unshuffled_order_and_small_sources():
    it = PromptIterator(Numbered(3), batch_size=5, seed=0, shuffle=False)
    assert ids(it.next()) == [0, 1, 2, 0, 1]
    assert it.state() == {"epoch": 1, "position": 2}


def test_same_seed_same_stream_other_seed_other_stream():
    a = PromptIterator(Numbered(50), batch_size=8, seed=1)
    b = PromptIterator(Numbered(50), batch_size=8, seed=1)
    c = PromptIterator(Numbered(50), batch_size=8, seed=2)
    stream_a = [ids(a.next()) for _ in range(10)]
    assert stream_a == [ids(b.next()) for _ in range(10)]
    assert stream_a != [ids(c.next()) for _ in range(10)]


@pytest.mark.parametrize("steps_before_save", [0, 3, 5, 7])
def test_restore_continues_exactly(steps_before_save):
    source = Numbered(17)
    reference = PromptIterator(source, batch_size=5, seed=9)
    expected = [ids(reference.next()) for _ in range(12)]

    run = PromptIterator(source, batch_size=5, seed=9)
    for _ in range(steps_before_save):
        run.next()
    saved = json.loads(json.dumps(run.state()))  # through a checkpoint's JSON

    resumed = PromptIterator(source, batch_size=5, seed=9)
    resumed.restore(saved)
    assert [ids(resumed.next()) for _ in range(12 - steps_before_save)] == \
        expected[steps_before_save:]


def test_restore_accepts_numpy_integers():
    it = PromptIterator(Numbered(4), batch_size=2, seed=0)
    it.restore({"epoch": np.int64(2), "position": np.int32(1)})
    assert it.state() == {"epoch": 2, "position": 1}
    assert json.dumps(it.state())


@pytest.mark.parametrize("state, match", [
    ({"epoch": 0}, "keys"),
    ([0, 1], "keys"),
    ({"epoch": -1, "position": 0}, "epoch"),
    ({"epoch": 0, "position": 11}, r"position must be an int in \[0, 10\]"),
    ({"epoch": 0, "position": 1.5}, "position"),
])
def test_restore_rejects_bad_state(state, match):
    it = PromptIterator(Numbered(10), batch_size=2, seed=0)
    with pytest.raises(ValueError, match=match):
        it.restore(state)


def test_constructor_rejects_bad_arguments():
    with pytest.raises(ValueError, match="empty"):
        PromptIterator(Numbered(0), batch_size=2, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        PromptIterator(Numbered(3), batch_size=0, seed=0)
    with pytest.raises(ValueError, match="seed"):
        PromptIterator(Numbered(3), batch_size=1, seed="0")
