"""An evaluation's figures file (``eval.json``) read back, checked as data from elsewhere.

``tpe-study report``, ``archive`` and ``extrapolate`` read the figures of runs that may come from
another machine (an archive handed on) or have been damaged, so each value they use is checked for its
type before use: a figure is a finite number (or null where the evaluation leaves it out), a count a
non-negative integer (never a boolean), a name a string; the length buckets and the per-set figures
are objects of the same; the file is at most ``MAX_FIGURES`` bytes. Keys the readers do not use are left
as they are. Any other content is one ``MemberError`` naming the file, the key and the fix.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tpe_train.run.members import MIB, MemberError, read_json

#: An evaluation of many test sets with many buckets is a few KiB.
MAX_FIGURES = 16 * MIB

#: Scores: a finite number, or null where the evaluation has none (no probes in the corpus).
SCORES = ("bleu", "chrf", "exact_match", "probe_accuracy", "bleu_tokenized", "bleu_lc_tokenized")
#: Counts: a non-negative integer.
COUNTS = ("probe_pairs", "test_sentences", "too_long")
#: Names: a string.
NAMES = ("test_set", "bleu_signature", "bleu_tokenized_method", "bleu_lc_tokenized_method")
FIX = "evaluate the run again (tpe-eval) or use an undamaged copy of its folder"


def read_figures(folder: Path, name: str) -> dict[str, Any]:
    """``folder/name`` as a checked figures object (``check_figures``)."""
    data = read_json(folder, name, limit=MAX_FIGURES)
    return check_figures(data, Path(folder) / name)


def check_figures(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """``data`` when every figure its readers use has its type; otherwise a ``MemberError``."""
    _check_set(data, path, "")
    if "bleu" not in data:
        _refuse(path, "'bleu'", "missing", "a number")
    sets = data.get("sets", {})
    _expect(isinstance(sets, dict), path, "'sets'", sets, "an object of test sets")
    for set_name, figures in sets.items():
        _expect(isinstance(figures, dict), path, f"'sets'.{set_name!r}", figures, "an object")
        _check_set(figures, path, f"'sets'.{set_name!r}.")
    selected = data.get("selected")
    if selected is not None:
        _expect(isinstance(selected, dict), path, "'selected'", selected, "an object")
        export = selected.get("export")
        _expect(export is None or isinstance(export, str), path, "'selected'.'export'", export, "a string")
    return data


def _check_set(figures: dict[str, Any], path: Path, prefix: str) -> None:
    for key in SCORES:
        _score(figures.get(key), path, f"{prefix}{key!r}")
    for key in COUNTS:
        _count(figures.get(key, 0), path, f"{prefix}{key!r}")
    for key in NAMES:
        value = figures.get(key)
        _expect(value is None or isinstance(value, str), path, f"{prefix}{key!r}", value, "a string")
    buckets = figures.get("bleu_by_length", {})
    _expect(isinstance(buckets, dict), path, f"{prefix}'bleu_by_length'", buckets, "an object of buckets")
    for bucket, entry in buckets.items():
        where = f"{prefix}'bleu_by_length'.{bucket!r}"
        _expect(isinstance(entry, dict), path, where, entry, "an object")
        _score(entry.get("bleu"), path, f"{where}.'bleu'")
        for key in ("sentences", "unrepresentable"):
            _count(entry.get(key, 0), path, f"{where}.{key!r}")


def _score(value: object, path: Path, what: str) -> None:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    _expect(value is None or (number and math.isfinite(value)), path, what, value, "a finite number")  # type: ignore[arg-type]


def _count(value: object, path: Path, what: str) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    _expect(ok, path, what, value, "a non-negative integer")


def _expect(ok: bool, path: Path, what: str, value: object, wanted: str) -> None:
    if not ok:
        _refuse(path, what, repr(value)[:60], wanted)


def _refuse(path: Path, what: str, found: str, wanted: str) -> None:
    raise MemberError(f"{path}: {what} is {found}, where {wanted} is expected; {FIX}")
