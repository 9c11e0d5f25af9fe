"""The training batches of one data-parallel rank: from the token store (``BatchIterator``) or, with
``data.streaming``, from the cleaned stream tokenised on the fly (``StreamingBatches``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from tpe_train.config import DataConfig
from tpe_train.data.batching import Batch, BatchIterator, BatchState, collate, length_arrays
from tpe_train.data.prepare import Prepared
from tpe_train.data.specs import clean_spec, corpus_spec
from tpe_train.data.splits import train_stream
from tpe_train.data.streaming import StreamingBatches


class TrainBatches:
    """The training batches of one data-parallel rank, with a resumable position.

    ``state_dict()`` is plain JSON data. Pre-tokenised data keeps one global position, the same on
    every rank and valid for any number of ranks; a streamed corpus keeps each rank's own stream
    state, valid only for the same number of ranks (``per_rank``)."""

    def __init__(
        self, data: Prepared, cfg: DataConfig, seed: int, dp_rank: int = 0, dp_size: int = 1
    ) -> None:
        self.data, self.per_rank = data, cfg.streaming
        if cfg.streaming:
            self.stream: StreamingBatches | None = StreamingBatches(
                train_stream(corpus_spec(cfg), clean_spec(cfg.clean)),
                data.tokenizer,
                cfg.max_tokens,
                seed,
                cfg.shuffle_buffer,
                max_len=cfg.max_len,
                dp_rank=dp_rank,
                dp_size=dp_size,
            )
            self.batches: BatchIterator | None = None
        else:
            self.stream = None
            src_len, tgt_len = length_arrays(data.train)
            self.batches = BatchIterator(
                src_len, tgt_len, cfg.max_tokens, seed, dp_rank=dp_rank, dp_size=dp_size
            )
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self._it is None:
            self._it = iter(self.stream) if self.stream is not None else iter(self.batches)  # type: ignore[arg-type]
        item = next(self._it)
        if self.stream is not None:
            assert isinstance(item, Batch)
            return item
        assert isinstance(item, np.ndarray)
        return collate(self.data.train, item)

    def state_dict(self) -> dict[str, Any]:
        if self.stream is not None:
            return {"stream": self.stream.state_dict()}
        assert self.batches is not None
        return {"epoch": self.batches.state.epoch, "taken": self.batches.state.taken}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._it = None
        if self.stream is not None:
            self.stream.load_state_dict(state["stream"])
        else:
            assert self.batches is not None
            self.batches.state = BatchState(int(state["epoch"]), int(state["taken"]))
