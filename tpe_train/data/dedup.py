"""De-duplicate: keep the first occurrence of each pair, in corpus order, in bounded memory.

A pair's key is an 8-byte hash of ``f"{src}\\t{tgt}"`` (blake2b): at 36M pairs two different pairs share
one with a probability of about 4e-5. Two passes:

1. The pairs are hashed ``batch_size`` at a time. Within a batch only the first row of each key is
   kept (later copies are duplicates for sure); the (key, row) records go to ``2**k`` bucket files on
   disk, chosen by the key's top ``k`` bits, ``2**k`` the smallest power of two that puts at most
   ``bucket_rows`` rows of the corpus in a bucket on average.
2. One bucket at a time is read back; ``np.unique(keys, return_index=True)`` sorts with a stable sort
   (mergesort), so it gives the first record of each key, and records are appended in row order, so
   that is the key's first row. Those rows are set in a keep bitmap.

The Dataset is then filtered by the bitmap (``filter`` writes an indices mapping, no copy of the text).

Memory: the bitmap, one bit a row (n/8 bytes: 4.5 MB at 36M pairs), one bucket in pass 2 (16 bytes a
record, about 50 bytes a record while sorting: about 100 MB at the default ``bucket_rows`` of 2M, up to
512M rows; there are at most 256 buckets), and one batch of text. A pair repeated in every batch adds
one record a batch to its bucket, so even one pair copied millions of times adds at most rows /
``batch_size`` records. Measured (generated pairs, 40% duplicates): 0.20 GiB of anonymous memory for
the whole process at 8M pairs and 0.21 GiB at 16M, where one array of all keys took 0.67 and 1.09 GiB.
The Arrow pages pass 1 reads are memory-mapped: they count in RSS, but are file pages the kernel drops.
Disk: 16 bytes a record (under 600 MB at 36M pairs), in a temporary folder beside the Dataset's cache
files (else the system's temporary folder), removed when done, also on error (not when the process is
killed).
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import BinaryIO

import numpy as np
from datasets import Dataset

BUCKET_ROWS = 2**21  # rows of the corpus per bucket, on average
BATCH_SIZE = 20_000  # pairs hashed at a time
MAX_BITS = 8  # at most 256 buckets (past 512M rows at the default size, a bucket holds more)
RECORD = np.dtype([("key", "<u8"), ("row", "<u8")])


def pair_keys(src: list[str], tgt: list[str]) -> np.ndarray:
    """An 8-byte hash of each pair (as uint64)."""
    keys = [
        hashlib.blake2b(f"{s}\t{t}".encode(), digest_size=8).digest() for s, t in zip(src, tgt, strict=True)
    ]
    return np.frombuffer(b"".join(keys), dtype=np.uint64)


def bucket_bits(rows: int, bucket_rows: int) -> int:
    """``k`` of the ``2**k`` buckets: the fewest that hold at most ``bucket_rows`` rows each on average
    (at most ``MAX_BITS``: the bucket files are open together in pass 1)."""
    return min(MAX_BITS, math.ceil(math.log2(rows / bucket_rows))) if rows > bucket_rows else 0


def scratch_root(ds: Dataset) -> Path | None:
    """The folder of the Dataset's first cache file, if this process may write there; else None (the
    system's temporary folder)."""
    if not ds.cache_files:
        return None
    folder = Path(ds.cache_files[0]["filename"]).parent
    return folder if os.access(folder, os.W_OK) else None


def first_of_each(
    ds: Dataset,
    bucket_rows: int = BUCKET_ROWS,
    batch_size: int = BATCH_SIZE,
    scratch: Path | None = None,
) -> tuple[Dataset, int]:
    """The first occurrence of each pair of a src/tgt Dataset, in corpus order, and the number of
    later copies dropped. Bucket files go to a temporary folder in ``scratch`` (default: beside the
    Dataset's cache files)."""
    rows = len(ds)
    bits = bucket_bits(rows, bucket_rows)
    root = scratch or scratch_root(ds)
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tpe-dedup-", dir=root) as folder:
        paths = [Path(folder) / f"bucket-{b:05d}.bin" for b in range(2**bits)]
        _write_buckets(ds, paths, bits, batch_size)
        keep, kept = _keep_bitmap(paths, rows)
    if kept == rows:
        return ds, 0

    def first(indices: list[int]) -> list[bool]:
        return bits_at(keep, np.asarray(indices, dtype=np.int64)).tolist()

    return ds.filter(first, with_indices=True, input_columns=[], batched=True, batch_size=10_000), rows - kept


def _write_buckets(ds: Dataset, paths: list[Path], bits: int, batch_size: int) -> None:
    """Pass 1: the (key, row) record of each key's first row in each batch, into its bucket's file."""
    with ExitStack() as stack:
        files: list[BinaryIO] = [stack.enter_context(open(p, "wb")) for p in paths]
        start = 0
        for batch in ds.iter(batch_size=batch_size):
            keys = pair_keys(batch["src"], batch["tgt"])
            _, first = np.unique(keys, return_index=True)  # the first row of each key in this batch
            records = np.empty(len(first), RECORD)
            records["key"] = keys[first]
            records["row"] = start + first
            start += len(keys)
            if bits == 0:
                files[0].write(records.tobytes())
                continue
            bucket = (records["key"] >> np.uint64(64 - bits)).astype(np.int64)
            order = np.argsort(bucket, kind="stable")  # rows stay in order within a bucket
            records = records[order]
            bounds = np.searchsorted(bucket[order], np.arange(len(paths) + 1))
            for b in np.flatnonzero(np.diff(bounds)).tolist():
                files[b].write(records[bounds[b] : bounds[b + 1]].tobytes())


def _keep_bitmap(paths: list[Path], rows: int) -> tuple[np.ndarray, int]:
    """Pass 2: one bit a row (``np.packbits`` order), set for the first row of each key; and how many
    rows are set."""
    keep, kept = np.zeros((rows + 7) // 8, dtype=np.uint8), 0
    for path in paths:
        records = np.fromfile(path, dtype=RECORD)
        path.unlink()
        if len(records) == 0:
            continue
        _, first = np.unique(records["key"], return_index=True)  # stable: each key's first record
        _set_bits(keep, np.sort(records["row"][first]))
        kept += len(first)
    return keep, kept


def _set_bits(bitmap: np.ndarray, rows: np.ndarray) -> None:
    """Set the bits of ``rows`` (sorted, distinct) in a ``np.packbits``-ordered bitmap."""
    byte = rows >> 3
    values = (np.uint8(0x80) >> (rows & 7).astype(np.uint8)).astype(np.uint8)
    starts = np.flatnonzero(np.r_[True, byte[1:] != byte[:-1]])
    bitmap[byte[starts]] |= np.bitwise_or.reduceat(values, starts)


def bits_at(bitmap: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The bits of ``rows`` in a ``np.packbits``-ordered bitmap, as booleans."""
    return ((bitmap[rows >> 3] >> (7 - (rows & 7)).astype(np.uint8)) & 1).astype(bool)
