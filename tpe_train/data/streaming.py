"""Streaming token batches, for corpora too large to prepare on one machine.

A `datasets` IterableDataset (``load_dataset(..., streaming=True)`` or any iterable of src/tgt
records) is split by data-parallel rank (``split_dataset_by_node``: whole shards per rank when the
shard count divides the ranks), passed through a seeded shuffle buffer, tokenised on the fly and
grouped into batches of at most ``max_tokens`` padded source + target tokens. Epochs repeat without
end (training is counted in steps), so no rank ever waits on another's short last batch.

The state is exact in every epoch: a restored iterator yields exactly the batches (ids and tokens) the
original would have yielded next, on each rank, and a restored run saves a state that restores exactly
again. It is plain JSON-able data: the epoch, the number of records read from this rank's share of the
source this epoch (``seen``), the source's own position (``IterableDataset.state_dict``), the shuffle
buffer's contents, the pairs already drawn for the next batch and the generator state.

A restore splits the source afresh and sets its epoch (``set_epoch``) before it applies the saved
position: ``datasets`` applies a position only in the epoch it was saved in, and a fresh source is at
epoch 0, so a position saved after the first epoch is otherwise ignored and the epoch starts over. The
source's position is used where it belongs to the saved epoch and has moved if ``seen`` has; otherwise
(a state that an older version saved right after a restore, before reading on) the restore reads the
first ``seen`` records of the epoch's share again and drops them.

Cost of a restore: ``datasets`` skips the shards already read and reads the saved shard again from its
start up to the position: Arrow-backed shards (a hub or save_to_disk corpus) as Arrow tables, generator
sources by running the shard's generator (a text corpus is one shard: its files up to the position; a
streamed parquet split reads the saved row group). The fallback reads, and cleans, the consumed part of
the current epoch of the rank's share again. Nothing read again is tokenised.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from typing import Any

from datasets import IterableDataset
from datasets.distributed import split_dataset_by_node
from tokenizers import Tokenizer

from tpe_train.data.batching import BOS_ID, EOS_ID, Batch, pad
from tpe_train.data.errors import CorpusError
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
        self._whole, self._size = source, dp_size
        self.source = split_dataset_by_node(source, rank=dp_rank, world_size=dp_size)
        self._start = self.source.state_dict()  # the position before any record, laid out as in epoch 0
        self.tok, self.max_tokens, self.max_len = tok, max_tokens, max_len
        self.seed, self.rank, self.buffer_size = seed, dp_rank, buffer_size
        self.epoch = 0
        self.buffer: list[tuple[int, str, str]] = []  # (id column or stream index, src, tgt)
        self.pending: list[tuple[int, list[int], list[int]]] = []  # drawn for the next batch
        self.rng = random.Random(f"{seed}-{dp_rank}-0")
        self.seen = 0  # pairs read from the source this epoch
        self._restored: dict[str, Any] | None = None  # the loaded source position, until read on
        self._skip = 0  # records to read again and drop before reading on (a restore's fallback)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly here (plain Python data)."""
        restored = self._restored is not None  # not read on since the restore: the loaded position
        return {
            "epoch": self.epoch,
            "source": self._restored if restored else self.source.state_dict(),
            "buffer": list(self.buffer),
            "pending": list(self.pending),
            "rng": self.rng.getstate(),
            "seen": self.seen,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` was saved (by this version or an older one), in any epoch."""
        missing = {"epoch", "seen", "buffer", "pending", "rng"} - set(state)
        if missing:
            raise ValueError(
                f"a stream state needs {', '.join(sorted(missing))}: it was not saved by StreamingBatches; "
                "resume from a checkpoint of a streamed run (data.streaming=true) on as many ranks"
            )
        self.epoch, self.seen = int(state["epoch"]), int(state["seen"])
        self.source = split_dataset_by_node(self._whole, rank=self.rank, world_size=self._size)
        self.source.set_epoch(self.epoch)  # datasets applies a position only in its own epoch
        position = state.get("source")
        if self._position_holds(position):
            self.source.load_state_dict(position)
            self._skip = 0
        else:
            self._skip = self.seen
        self._restored = position
        self.buffer = [tuple(x) for x in state["buffer"]]
        self.pending = [tuple(x) for x in state["pending"]]
        rng_state = state["rng"]
        self.rng.setstate((rng_state[0], tuple(rng_state[1]), rng_state[2]))

    def _position_holds(self, position: Any) -> bool:
        """Whether the saved source position is this epoch's and has moved if any record was read
        (the start is laid out as in epoch 0: only a stale epoch-0 position matches it)."""
        if not isinstance(position, dict) or position.get("epoch") != self.epoch:
            return False
        at_start = position.get("examples_iterable") == self._start.get("examples_iterable")
        return self.seen == 0 or not at_start

    def _draw(self) -> Iterator[tuple[int, str, str]]:
        """Pairs in shuffled order: fill the buffer from the stream, emit a random member."""
        records = iter(self.source)
        if self._skip:  # the restore's fallback: these records are already in the state
            dropped = sum(1 for _ in itertools.islice(records, self._skip))
            if dropped < self._skip:
                raise ValueError(
                    f"the stream state has read {self._skip} records of epoch {self.epoch} of rank "
                    f"{self.rank}'s share but the source holds {dropped}: resume on the same corpus, "
                    "cleaning settings and number of ranks"
                )
        self._skip, self._restored = 0, None
        for record in records:
            self.buffer.append((record.get("id", self.seen), record["src"], record["tgt"]))
            self.seen += 1
            if len(self.buffer) >= self.buffer_size:
                yield self._pop()
        while self.buffer:
            yield self._pop()

    def _empty_share(self) -> str:
        """The error of an epoch read from its start that made no batch."""
        share = f"rank {self.rank}'s share (of {self._size} ranks)" if self._size > 1 else "the stream"
        if self.seen == 0:
            fix = (
                "give the corpus at least as many shards (files) as there are ranks, or use fewer ranks"
                if self._size > 1
                else "check the training split and data.clean.*"
            )
            return f"{share} of the training corpus holds no pair, so it makes no batch; {fix}"
        return (
            f"none of the {self.seen} pairs in {share} of the training corpus fits data.max_len="
            f"{self.max_len} tokens on both sides, so it makes no batch; raise data.max_len"
        )

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
            from_start = self.seen == 0 and not self.buffer and not self.pending and not self._skip
            yielded = False
            for idx, src, tgt in self._draw():
                s_ids, t_ids = ([*ids, EOS_ID] for ids in encode(self.tok, [src, tgt]))
                if not fits(len(s_ids), len(t_ids), self.max_len):
                    continue
                rows = [*self.pending, (idx, s_ids, t_ids)]
                width = max(len(r[1]) for r in rows) + max(len(r[2]) for r in rows)
                if len(rows) > 1 and width * len(rows) > self.max_tokens:
                    batch = self._batch(self.pending)
                    self.pending = [(idx, s_ids, t_ids)]
                    yielded = True
                    yield batch
                else:
                    self.pending = rows
            if self.pending:  # the epoch's last, smaller batch: every pair once per epoch
                batch, self.pending = self._batch(self.pending), []
                yielded = True
                yield batch
            if from_start and not yielded:  # another epoch would find nothing either: never loop on
                raise CorpusError(self._empty_share())
            self.epoch += 1
            self.seen = 0
            self.source.set_epoch(self.epoch)
            self.rng = random.Random(f"{self.seed}-{self.rank}-{self.epoch}")
