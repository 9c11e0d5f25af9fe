"""Token batches: limits, coverage, determinism, resumable state, data-parallel sharding."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tpe_train.data.batching import BatchIterator, BatchState, token_batches
from tpe_train.data.errors import CorpusError


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
    steps = len(full.batches)
    reference = [b.tolist() for b in itertools.islice(iter(full), steps + 10)]  # crosses an epoch
    partial = BatchIterator(src, tgt, 600, seed=3)
    it = iter(partial)
    head = [next(it).tolist() for _ in range(steps - 5)]
    saved = BatchState(partial.state.epoch, partial.state.taken)
    resumed = BatchIterator(src, tgt, 600, seed=3, state=saved)
    tail = [b.tolist() for b in itertools.islice(iter(resumed), 15)]
    assert head + tail == reference


def global_stream(its: list[BatchIterator], steps: int) -> list[list[int]]:
    """Batches of all data-parallel ranks, step by step, rank by rank: the global stream."""
    streams = [iter(it) for it in its]
    return [next(s).tolist() for _ in range(steps) for s in streams]


@pytest.mark.parametrize("dp_size", [2, 3, 4])
def test_data_parallel_ranks_see_every_pair_exactly_once_per_epoch(dp_size: int) -> None:
    src, tgt = lengths()
    ranks = [BatchIterator(src, tgt, 600, seed=5, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    n = len(ranks[0].batches)
    stream = global_stream(ranks, -(-2 * n // dp_size))  # two epochs and a bit
    single = [b.tolist() for b in itertools.islice(iter(BatchIterator(src, tgt, 600, seed=5)), len(stream))]
    assert stream == single  # the same global stream as one process
    for epoch in (stream[:n], stream[n : 2 * n]):
        assert sorted(np.concatenate(epoch).tolist()) == list(range(len(src)))
    assert all(it.state == ranks[0].state for it in ranks)  # every rank knows the same position


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (3, 2)])
def test_the_position_carries_over_to_another_number_of_ranks(before: int, after: int) -> None:
    src, tgt = lengths()
    reference = [b.tolist() for b in itertools.islice(iter(BatchIterator(src, tgt, 600, seed=7)), 120)]
    first = [BatchIterator(src, tgt, 600, seed=7, dp_rank=r, dp_size=before) for r in range(before)]
    head = global_stream(first, 37)
    state = first[0].state
    saved = (state.epoch, state.taken)
    second = [
        BatchIterator(src, tgt, 600, seed=7, dp_rank=r, dp_size=after, state=BatchState(*saved))
        for r in range(after)
    ]
    tail = global_stream(second, (120 - len(head)) // after)
    assert head + tail == reference[: len(head) + len(tail)]  # nothing lost, nothing repeated


def test_tensor_parallel_peers_get_identical_batches() -> None:
    src, tgt = lengths()
    peers = [BatchIterator(src, tgt, 600, seed=5, dp_rank=1, dp_size=2) for _ in range(2)]
    a, b = (list(itertools.islice(iter(it), 30)) for it in peers)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_too_few_batches_for_the_ranks_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="fewer than the 4 data-parallel ranks"):
        BatchIterator(np.array([3, 4]), np.array([3, 4]), 600, seed=0, dp_size=4)


def test_an_empty_training_split_is_a_corpus_error_naming_the_fix() -> None:
    with pytest.raises(CorpusError, match=r"holds no pair.*\(tpe-data prepare\)"):
        BatchIterator(np.array([], dtype=np.int64), np.array([], dtype=np.int64), 600, seed=0)
