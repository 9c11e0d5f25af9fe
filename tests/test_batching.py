"""Token batches: limits, coverage, determinism, resumable state, data-parallel sharding."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tpe_train.data.batching import BatchIterator, BatchState, token_batches


def lengths(n: int = 500, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, 60, n), rng.integers(3, 70, n)


def test_batches_respect_the_token_limit_and_cover_every_pair_once() -> None:
    src, tgt = lengths()
    batches = token_batches(src, tgt, max_tokens=600, seed=1)
    for b in batches:
        assert (src[b].max() + tgt[b].max()) * len(b) <= 600
    seen = np.concatenate(batches)
    assert sorted(seen.tolist()) == list(range(len(src)))


def test_same_seed_same_order_other_seed_other_order() -> None:
    src, tgt = lengths()
    first = [b.tolist() for b in itertools.islice(BatchIterator(src, tgt, 600, seed=3), 20)]
    again = [b.tolist() for b in itertools.islice(BatchIterator(src, tgt, 600, seed=3), 20)]
    other = [b.tolist() for b in itertools.islice(BatchIterator(src, tgt, 600, seed=4), 20)]
    assert first == again and first != other


def test_restored_state_gives_exactly_the_remaining_batches() -> None:
    src, tgt = lengths()
    full = BatchIterator(src, tgt, 600, seed=3)
    steps = full.steps_per_epoch
    reference = [b.tolist() for b in itertools.islice(iter(full), steps + 10)]  # crosses an epoch
    partial = BatchIterator(src, tgt, 600, seed=3)
    it = iter(partial)
    head = [next(it).tolist() for _ in range(steps - 5)]
    saved = BatchState(partial.state.epoch, partial.state.step_in_epoch)
    resumed = BatchIterator(src, tgt, 600, seed=3, state=saved)
    tail = [b.tolist() for b in itertools.islice(iter(resumed), 15)]
    assert head + tail == reference


@pytest.mark.parametrize("dp_size", [2, 3, 4])
def test_data_parallel_ranks_see_every_pair_exactly_once_per_epoch(dp_size: int) -> None:
    src, tgt = lengths()
    ranks = [BatchIterator(src, tgt, 600, seed=5, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    steps = ranks[0].steps_per_epoch
    assert all(it.steps_per_epoch == steps for it in ranks)  # nobody waits on a short last batch
    seen = np.concatenate([np.concatenate(list(itertools.islice(iter(it), steps))) for it in ranks])
    assert sorted(seen.tolist()) == list(range(len(src)))
    for it in ranks:
        assert it.state == BatchState(0, steps)
        for b in it.batches:
            assert (src[b].max() + tgt[b].max()) * len(b) <= 600


def test_tensor_parallel_peers_get_identical_batches() -> None:
    src, tgt = lengths()
    peers = [BatchIterator(src, tgt, 600, seed=5, dp_rank=1, dp_size=2) for _ in range(2)]
    a, b = (list(itertools.islice(iter(it), 30)) for it in peers)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_too_few_pairs_for_the_ranks_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="fewer than the 4 data-parallel ranks"):
        BatchIterator(np.array([3, 4]), np.array([3, 4]), 600, seed=0, dp_size=4)
