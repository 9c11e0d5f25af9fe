"""Streaming batches: ranks split the stream, token limits hold, a restored state is exact."""

from __future__ import annotations

import itertools

from datasets import Dataset

from tpe_train.data import synthetic
from tpe_train.data.streaming import StreamingBatches
from tpe_train.data.tokenizer import train_tokenizer

PAIRS = synthetic.generate(400, 7, 4, 20)
TOK = train_tokenizer([s for p in PAIRS for s in p], 200)


def stream(**kw: int) -> StreamingBatches:
    source = Dataset.from_dict(
        {"id": list(range(len(PAIRS))), "src": [p[0] for p in PAIRS], "tgt": [p[1] for p in PAIRS]}
    )
    return StreamingBatches(source.to_iterable_dataset(num_shards=4), TOK, max_tokens=400, seed=3, **kw)


def ids_of(batches: list) -> list[list[int]]:  # type: ignore[type-arg]
    return [b.ids.tolist() for b in batches]


def test_ranks_split_the_stream_each_pair_once_per_epoch_within_the_token_limit() -> None:
    per_rank = []
    for rank in range(2):
        it = stream(dp_rank=rank, dp_size=2, buffer_size=50)
        ids: list[int] = []
        for batch in iter(it):
            if it.epoch:  # the first batch of the next epoch
                break
            width = batch.src.shape[1] + batch.tgt_out.shape[1]
            assert width * len(batch.ids) <= 400 or len(batch.ids) == 1
            ids += batch.ids.tolist()
        per_rank.append(ids)
    assert not set(per_rank[0]) & set(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == list(range(len(PAIRS)))


def test_same_seed_same_batches() -> None:
    a = ids_of(list(itertools.islice(iter(stream(buffer_size=64)), 12)))
    b = ids_of(list(itertools.islice(iter(stream(buffer_size=64)), 12)))
    assert a == b


def test_restored_state_continues_exactly() -> None:
    reference = ids_of(list(itertools.islice(iter(stream(buffer_size=64)), 40)))  # crosses an epoch
    first = stream(buffer_size=64)
    it = iter(first)
    head = ids_of([next(it) for _ in range(13)])
    state = first.state_dict()
    resumed = stream(buffer_size=64)
    resumed.load_state_dict(state)
    tail = ids_of(list(itertools.islice(iter(resumed), 27)))
    assert head + tail == reference
