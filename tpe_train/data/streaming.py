"""Streaming token batches, for corpora too large to prepare on one machine.

A `datasets` IterableDataset (``load_dataset(..., streaming=True)`` or any iterable of src/tgt
records) is split by data-parallel rank (``split_dataset_by_node``: whole shards per rank when the
shard count divides the ranks), passed through a seeded shuffle buffer, tokenised on the fly and
grouped into batches of at most ``max_tokens`` padded source + target tokens. Epochs repeat without
end (training is counted in steps), so no rank ever waits on another's short last batch.

The state is exact: the source's own position (``IterableDataset.state_dict``), the shuffle buffer's
contents, the pairs already drawn for the next batch, the generator state and the epoch. A restored
iterator yields exactly the batches the original would have yielded next.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from datasets import IterableDataset
from datasets.distributed import split_dataset_by_node
from tokenizers import Tokenizer

from tpe_train.data.batching import BOS_ID, EOS_ID, Batch, pad
from tpe_train.data.lengths import fits
from tpe_train.data.tokenizer import encode


class StreamingBatches:
    """Endless token batches of one data-parallel rank from an IterableDataset with src/tgt."""

    def __init__(
        self,
        source: IterableDataset,
        tok: Tokenizer,
        max_tokens: int,
        seed: int,
        buffer_size: int = 10_000,
        dp_rank: int = 0,
        dp_size: int = 1,
        max_len: int = 256,
    ) -> None:
        self.source = split_dataset_by_node(source, rank=dp_rank, world_size=dp_size)
        self.tok, self.max_tokens, self.max_len = tok, max_tokens, max_len
        self.seed, self.rank, self.buffer_size = seed, dp_rank, buffer_size
        self.epoch = 0
        self.buffer: list[tuple[int, str, str]] = []  # (id column or stream index, src, tgt)
        self.pending: list[tuple[int, list[int], list[int]]] = []  # drawn for the next batch
        self.rng = random.Random(f"{seed}-{dp_rank}-0")
        self.seen = 0  # pairs read from the source this epoch

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly here (plain Python data)."""
        return {
            "epoch": self.epoch,
            "source": self.source.state_dict(),
            "buffer": list(self.buffer),
            "pending": list(self.pending),
            "rng": self.rng.getstate(),
            "seen": self.seen,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.seen = state["epoch"], state["seen"]
        self.source.load_state_dict(state["source"])
        self.buffer = [tuple(x) for x in state["buffer"]]
        self.pending = [tuple(x) for x in state["pending"]]
        rng_state = state["rng"]
        self.rng.setstate((rng_state[0], tuple(rng_state[1]), rng_state[2]))

    def _draw(self) -> Iterator[tuple[int, str, str]]:
        """Pairs in shuffled order: fill the buffer from the stream, emit a random member."""
        for record in self.source:
            self.buffer.append((record.get("id", self.seen), record["src"], record["tgt"]))
            self.seen += 1
            if len(self.buffer) >= self.buffer_size:
                yield self._pop()
        while self.buffer:
            yield self._pop()

    def _pop(self) -> tuple[int, str, str]:
        i = self.rng.randrange(len(self.buffer))
        self.buffer[i], self.buffer[-1] = self.buffer[-1], self.buffer[i]
        return self.buffer.pop()

    def _batch(self, rows: list[tuple[int, list[int], list[int]]]) -> Batch:
        return Batch(
            ids=pad([[r[0]] for r in rows]).flatten(),
            src=pad([r[1] for r in rows]),
            tgt_in=pad([r[2][:-1] for r in rows], prefix=BOS_ID),
            tgt_out=pad([r[2] for r in rows]),
        )

    def __iter__(self) -> Iterator[Batch]:
        while True:
            for idx, src, tgt in self._draw():
                s_ids, t_ids = ([*ids, EOS_ID] for ids in encode(self.tok, [src, tgt]))
                if not fits(len(s_ids), len(t_ids), self.max_len):
                    continue
                rows = [*self.pending, (idx, s_ids, t_ids)]
                width = max(len(r[1]) for r in rows) + max(len(r[2]) for r in rows)
                if len(rows) > 1 and width * len(rows) > self.max_tokens:
                    batch = self._batch(self.pending)
                    self.pending = [(idx, s_ids, t_ids)]
                    yield batch
                else:
                    self.pending = rows
            if self.pending:  # the epoch's last, smaller batch: every pair once per epoch
                batch, self.pending = self._batch(self.pending), []
                yield batch
            self.epoch += 1
            self.seen = 0
            self.source.set_epoch(self.epoch)
            self.rng = random.Random(f"{self.seed}-{self.rank}-{self.epoch}")
