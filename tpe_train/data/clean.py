"""Clean: the pipeline's second stage, configurable and reported: every dropped pair is counted
under its reason.

Unicode normalisation and whitespace clean-up rewrite the text; then pairs are dropped for being
empty, too short or too long (in whitespace-separated words), or for a source/target length ratio
beyond the limit (as Moses' clean-corpus-n.perl). Each step is a pass over the Arrow data on disk.
Exact duplicates are the next stage's (data/dedup.py).
"""

from __future__ import annotations

import unicodedata
from collections import Counter
from dataclasses import dataclass

from datasets import Dataset, IterableDataset

REASONS = ("empty", "too_short", "too_long", "ratio")


@dataclass(frozen=True, kw_only=True)
class CleanSpec:
    """Cleaning settings (a plain mirror of the ``data.clean`` section, de-duplication aside)."""

    normalize: str = "NFKC"  # NFC | NFKC | none
    min_words: int = 1
    max_words: int = 250
    max_ratio: float = 9.0  # 0: no ratio filter


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
    return kept, {reason: counts.get(reason, 0) for reason in REASONS}


def clean_stream(ds: IterableDataset, spec: CleanSpec) -> IterableDataset:
    """The same normalisation and filters, applied lazily (no counts: the stream has no end)."""

    def normalize(batch: dict[str, list[str]]) -> dict[str, list[str]]:
        return {
            "src": [_normalize_text(s, spec.normalize) for s in batch["src"]],
            "tgt": [_normalize_text(t, spec.normalize) for t in batch["tgt"]],
        }

    return ds.map(normalize, batched=True).filter(lambda r: _reason(r["src"], r["tgt"], spec) == "")
