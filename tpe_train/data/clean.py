"""Corpus cleaning, configurable and reported: every dropped pair is counted under its reason.

Unicode normalisation and whitespace clean-up rewrite the text; then pairs are dropped for being
empty, too short or too long (in whitespace-separated words), for a source/target length ratio beyond
the limit (as Moses' clean-corpus-n.perl), or, optionally, as exact duplicates of an earlier pair. Each
step is a pass over the Arrow data on disk; de-duplication keeps one 8-byte hash a pair in memory.
"""

from __future__ import annotations

import hashlib
import unicodedata
from collections import Counter
from dataclasses import dataclass

import numpy as np
from datasets import Dataset, IterableDataset

from tpe_train.config import CleanConfig

REASONS = ("empty", "too_short", "too_long", "ratio", "duplicate")


@dataclass(frozen=True, kw_only=True)
class CleanSpec:
    """Cleaning settings (a plain mirror of the config section)."""

    normalize: str = "NFKC"  # NFC | NFKC | none
    min_words: int = 1
    max_words: int = 250
    max_ratio: float = 9.0  # 0: no ratio filter
    dedup: bool = False


def clean_spec(c: CleanConfig) -> CleanSpec:
    """The cleaning the ``data.clean`` section asks for."""
    return CleanSpec(
        normalize=c.normalize,
        min_words=c.min_words,
        max_words=c.max_words,
        max_ratio=c.max_ratio,
        dedup=c.dedup,
    )


def _normalize_text(text: str, form: str) -> str:
    if form != "none":
        text = unicodedata.normalize(form, text)  # type: ignore[arg-type]
    return " ".join(text.split())  # strip, and collapse runs of whitespace


def _reason(src: str, tgt: str, spec: CleanSpec) -> str:
    ns, nt = len(src.split()), len(tgt.split())
    if ns == 0 or nt == 0:
        return "empty"
    if min(ns, nt) < spec.min_words:
        return "too_short"
    if max(ns, nt) > spec.max_words:
        return "too_long"
    if spec.max_ratio and max(ns / nt, nt / ns) > spec.max_ratio:
        return "ratio"
    return ""


def clean(ds: Dataset, spec: CleanSpec, num_proc: int | None = None) -> tuple[Dataset, dict[str, int]]:
    """Normalise and filter a src/tgt Dataset; returns (kept pairs, {reason: dropped count})."""

    def normalize(batch: dict[str, list[str]]) -> dict[str, list[str]]:
        src = [_normalize_text(s, spec.normalize) for s in batch["src"]]
        tgt = [_normalize_text(t, spec.normalize) for t in batch["tgt"]]
        return {"src": src, "tgt": tgt, "drop": [_reason(s, t, spec) for s, t in zip(src, tgt, strict=True)]}

    marked = ds.map(normalize, batched=True, num_proc=num_proc)
    reasons = marked.with_format("arrow")["drop"].value_counts()  # counted in Arrow, no Python list
    counts = Counter({r["values"]: r["counts"] for r in reasons.to_pylist()})
    kept = marked.filter(
        lambda r: [x == "" for x in r], input_columns="drop", batched=True, num_proc=num_proc
    )
    kept = kept.remove_columns("drop")
    if spec.dedup:
        kept, counts["duplicate"] = _first_of_each(kept)
    return kept, {reason: counts.get(reason, 0) for reason in REASONS}


def pair_keys(src: list[str], tgt: list[str]) -> np.ndarray:
    """An 8-byte hash of each pair (as uint64): at 36M pairs two different pairs share one with a
    probability of about 4e-5."""
    keys = [
        hashlib.blake2b(f"{s}\t{t}".encode(), digest_size=8).digest() for s, t in zip(src, tgt, strict=True)
    ]
    return np.frombuffer(b"".join(keys), dtype=np.uint64)


def _first_of_each(ds: Dataset) -> tuple[Dataset, int]:
    """The first occurrence of each pair, in corpus order, and the number of later copies dropped.
    Memory: the keys, 8 bytes a pair, as one array (no Python objects per pair)."""
    keys = np.concatenate(
        [pair_keys(b["src"], b["tgt"]) for b in ds.iter(batch_size=20_000)] or [np.zeros(0, np.uint64)]
    )
    _, first = np.unique(keys, return_index=True)
    del keys
    if len(first) == len(ds):
        return ds, 0
    return ds.select(np.sort(first)), len(ds) - len(first)


def format_report(split: str, before: int, dropped: dict[str, int]) -> str:
    """One line: kept pairs and the count dropped for each reason."""
    kept = before - sum(dropped.values())
    parts = ", ".join(f"{reason} {n}" for reason, n in dropped.items() if n)
    return f"{split}: {kept} of {before} pairs kept" + (f" (dropped: {parts})" if parts else "")


def clean_stream(ds: IterableDataset, spec: CleanSpec) -> IterableDataset:
    """The same normalisation and filters, applied lazily (no counts: the stream has no end)."""
    if spec.dedup:
        raise ValueError("exact deduplication needs the whole corpus; set data.clean.dedup=false to stream")

    def normalize(batch: dict[str, list[str]]) -> dict[str, list[str]]:
        return {
            "src": [_normalize_text(s, spec.normalize) for s in batch["src"]],
            "tgt": [_normalize_text(t, spec.normalize) for t in batch["tgt"]],
        }

    return ds.map(normalize, batched=True).filter(lambda r: _reason(r["src"], r["tgt"], spec) == "")
