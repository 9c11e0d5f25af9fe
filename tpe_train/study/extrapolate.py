"""Length extrapolation without retraining (``tpe-study extrapolate``): trained checkpoints x test-time
position methods x test sets, every cell decoded once and kept, then scored per source-length bucket
with sacreBLEU's bootstrap (95% confidence half-widths) and paired tests against the unmodified model.

- *Checkpoints*: exports given one by one, or every finished run of a study directory (the model its
  report scored: the averaged one with ``--average``, the one ``eval.select`` chose otherwise). Runs
  of one setting with several seeds form one row, pooled as the study report pools them.
- *Methods* (``position_methods``): the ``--position`` settings of ``tpe-eval`` by family
  and factor (``rope-yarn`` x 2 is ``rope.scaling=yarn rope.factor=2``); ``baseline`` is the unmodified
  model. A family applies to the checkpoints whose encoding it changes.
- *Test sets*: the model's test split (or ``--split``/``--src``/``--ref`` sets) and its
  ``--concat N`` versions (``evaluate.concatenated``: N consecutive sentences joined, real text at N
  times the lengths).

A cell (checkpoint, method, test set) is decoded by ``evaluate.evaluate`` and written by ``EvalFiles``
to ``OUT/cells/<checkpoint>/<method>/<set>/`` with the figures, the hypotheses and the references; a
cell whose files exist for the same weights, settings, sentences and decoding is not decoded again.
Every bad input (a missing checkpoint, an unknown method, a method no checkpoint can take, a bad
factor or set) stops before the first decoding.
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tpe_train.ckpt.export import WEIGHTS, load_export, read_meta
from tpe_train.ckpt.rundir import RunDir
from tpe_train.config import Config, ConfigError
from tpe_train.data.sources import CorpusError
from tpe_train.evaluation.decoding import DecodeOptions, InputError
from tpe_train.evaluation.evaluate import (
    EvalFiles,
    Evaluation,
    TestSet,
    concatenated,
    config_sets,
    corpus_sets,
    evaluate,
    file_set,
    length_bucket,
)
from tpe_train.evaluation.metrics import PairedResult, length_ratio, paired_bootstrap
from tpe_train.evaluation.position_settings import apply_position_settings
from tpe_train.run.members import check_name
from tpe_train.study.grid import Study, StudyError
from tpe_train.study.position_methods import BASELINE, FAMILIES, Method
from tpe_train.study.results import bucket_low

Print = Callable[[str], None]

ALL = "all"  # the bucket of every sentence of a set


# ---------------------------------------------------------------------------------------------------
# Checkpoints


@dataclass
class Checkpoint:
    """An export to extrapolate with, and the row it belongs to (``group``: its study setting, or its own
    label; seeds of one setting share a row)."""

    label: str
    path: Path
    group: str
    seed: int | None
    cfg: Config
    weights: str  # what identifies the weights in the cache: the SHA-256 its export recorded

    def encodings(self) -> dict[str, str]:
        """side -> the encoding acting there (sides without one left out)."""
        p = self.cfg.model.position
        found = {"encoder": p.kind if p.encoder else "none", "decoder": p.kind if p.decoder else "none",
                 "cross": p.cross}  # fmt: skip
        return {side: kind for side, kind in found.items() if kind != "none"}

    def takes(self, method: Method) -> bool:
        """Whether ``method`` changes an encoding this checkpoint uses on the method's sides."""
        if method.family == BASELINE:
            return True
        used = {kind for side, kind in self.encodings().items() if side in method.sides()}
        if method.family == "custom":
            return method.encodings() <= used
        return bool(method.encodings() & used)

    def describe(self) -> str:
        used = self.encodings()
        kinds = sorted(set(used.values()))
        if not kinds:
            return "no position encoding"
        if len(kinds) == 1 and len(used) >= 2 and set(used) >= {"encoder", "decoder"}:
            return kinds[0]
        return ", ".join(f"{side} {kind}" for side, kind in used.items())


def _weights_id(path: Path) -> str:
    recorded = read_meta(path).get("sha256", {}).get(WEIGHTS)
    if recorded:
        return str(recorded)
    stat = (path / WEIGHTS).stat()
    return f"{(path / WEIGHTS).resolve()}:{stat.st_size}:{stat.st_mtime_ns}"


def load_checkpoint(path: Path, label: str, group: str, seed: int | None) -> tuple[Checkpoint, Any]:
    """The checkpoint and its loaded (model, config, tokenizer); StudyError names a missing or bad one."""
    try:
        loaded = load_export(path)
    except (OSError, ValueError, ConfigError) as err:
        raise StudyError(f"checkpoint {label} ({path}): {err}") from None
    return Checkpoint(label, Path(path), group, seed, loaded[1], _weights_id(Path(path))), loaded


def label_of(path: Path, taken: set[str]) -> str:
    """``runs/x/checkpoint`` -> ``x``; ``runs/x/averaged-last5`` -> ``x-averaged-last5``; unique."""
    path = Path(path).resolve()
    if path.name == "checkpoint":
        label = path.parent.name
    elif path.name == "best" or path.name.startswith("averaged-"):
        label = f"{path.parent.name}-{path.name}"
    else:
        label = path.name
    label = re.sub(r"[^\w.+-]", "_", label) or "checkpoint"
    unique, n = label, 2
    while unique in taken:
        unique, n = f"{label}-{n}", n + 1
    taken.add(unique)
    return unique


def checkpoint_rows(
    paths: list[Path], labels: list[str] | None = None
) -> list[tuple[Path, str, str, int | None]]:
    """(export, label, row, seed) of exports given one by one (``--checkpoint``). With ``labels`` (one
    per path, ``--label``), each export is its own row of that name. Without: an export inside a
    study's layout (``STUDY/runs/s<seed>/<setting>/<export>``) is labelled and pooled as the study
    does: ``<setting>-s<seed>`` in the row ``<setting>`` (the first export of each setting and seed;
    another of the same run is its own row). Any other export is its own row (``label_of``)."""
    if labels:
        check_labels(labels, len(paths))
        return [(path, label, label, None) for path, label in zip(paths, labels, strict=True)]
    found: list[tuple[Path, str | None, str | None, int | None]] = []
    runs: set[tuple[str, int]] = set()
    for path in paths:
        resolved = Path(path).resolve()
        numbered = re.fullmatch(r"s(\d+)", resolved.parent.parent.name)
        run = (resolved.parent.name, int(numbered.group(1))) if numbered else None
        if run is not None and resolved.parent.parent.parent.name == "runs" and run not in runs:
            runs.add(run)
            found.append((path, f"{run[0]}-s{run[1]}", run[0], run[1]))
        else:
            found.append((path, None, None, None))
    taken = {label for _, label, _, _ in found if label} | {setting for setting, _ in runs}
    rows = []
    for path, label, row, seed in found:
        if label is None:
            label = row = label_of(path, taken)
        assert row is not None
        rows.append((path, label, row, seed))
    return rows


def check_labels(labels: list[str], checkpoints: int) -> None:
    """``--label``: one per ``--checkpoint``, distinct, usable as a file name (cells are kept under it)."""
    if len(labels) != checkpoints:
        raise StudyError(
            f"{len(labels)} --label for {checkpoints} --checkpoint: give each checkpoint its label, in "
            "the same order, or none (labels then come from the paths)"
        )
    bad = [label for label in labels if not re.fullmatch(r"[\w.+-]+", label) or label.startswith(".")]
    if bad:
        raise StudyError(
            f"--label {bad[0]!r} is not a usable name: labels name folders of the output, so use letters, "
            "digits and . _ + - (not starting with .)"
        )
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise StudyError(f"--label {repeated[0]!r} is given twice: each checkpoint's label must be its own")


def study_exports(study: Study) -> list[tuple[Path, str, str, int]]:
    """(export, label, setting, seed) of every run of a study: the model the study's report scored.
    A run without figures or without weights (not finished, or an archive) is an error naming it."""
    found, missing = [], []
    for setting, seed in study.grid():
        run = RunDir(study.run_dir(setting, seed))
        if study.average:
            export = study.averaged_dir(setting, seed)
        else:
            figures = study.eval_files(setting, seed).read_figures() or {}
            chosen = (figures.get("selected") or {}).get("export")
            name = check_name(Path(chosen).name, study.eval_path(setting, seed)) if chosen else None
            export = run.path / name if name else run.export
        if (export / WEIGHTS).is_file():
            found.append((export, f"{setting.name}-s{seed}", setting.name, seed))
        else:
            missing.append(f"{setting.name} seed {seed} ({export})")
    if missing:
        raise StudyError(
            f"{study.root}: {len(missing)} runs have no exported weights: {'; '.join(missing)}. Finish them "
            "(tpe-study run with the same arguments), or pass the checkpoints you want with --checkpoint "
            "(an archive keeps no weights: run on the study directory that trained)"
        )
    return found


# ---------------------------------------------------------------------------------------------------
# The grid


@dataclass(frozen=True)
class SetSpec:
    """Which test sets every checkpoint is scored on (from its own config's corpus)."""

    splits: tuple[str, ...] = ()  # empty: the config's test split
    files: tuple[tuple[str, str], ...] = ()  # (source, reference) files
    concat: tuple[int, ...] = (2, 3)
    limit: int | None = None

    def build(self, cfg: Config) -> list[TestSet]:
        """The sets, without the synthetic corpus's long and probe sentences (the cells score the test
        pairs); ``StudyError`` for a missing split or file."""
        try:
            base = corpus_sets(cfg.data, list(self.splits)) if self.splits else []
            base += [file_set(src, ref) for src, ref in self.files]
            base = base or config_sets(cfg.data)
            sets = [TestSet(s.name, s.pairs, pretokenized=s.pretokenized) for s in base]
            sets += [concatenated(s, n) for n in self.concat for s in list(sets)]
        except (CorpusError, InputError, ValueError) as err:
            raise StudyError(str(err)) from None
        if self.limit is not None:
            for test in sets:
                if len(test.pairs) > self.limit:
                    test.name, test.pairs = f"{test.name}[:{self.limit}]", test.pairs[: self.limit]
        names = [s.name for s in sets]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise StudyError(f"two test sets are named {', '.join(twice)}; give files of different names")
        empty = [s.name for s in sets if not s.pairs]
        if empty:
            raise StudyError(f"test set {', '.join(empty)} has no sentence (fewer than --concat N?)")
        return sets


def _safe(name: str) -> str:
    return re.sub(r"[^\w.+@-]", "_", name)


@dataclass
class Cell:
    """One (checkpoint, method, test set): decoded once, kept in ``directory``."""

    checkpoint: Checkpoint
    method: Method
    items: list[str]
    test_set: TestSet
    directory: Path
    decoding: dict[str, Any]

    def key(self) -> dict[str, Any]:
        """What the kept figures must have been computed from to be reused."""
        text = hashlib.sha256("\n".join(f"{s}\t{t}" for s, t in self.test_set.pairs).encode()).hexdigest()
        return {
            "weights": self.checkpoint.weights,
            "position": self.items,
            "test_set": self.test_set.name,
            "pairs": len(self.test_set.pairs),
            "text_sha256": text,
            "decoding": self.decoding,
        }

    @property
    def files(self) -> EvalFiles:
        return EvalFiles(self.directory)

    def done(self) -> bool:
        figures = self.files.read_figures()
        return (
            figures is not None
            and figures.get("extrapolate") == self.key()
            and self.files.read_set(self.test_set.name) is not None
        )


@dataclass
class Plan:
    """Every cell of one ``tpe-study extrapolate``, and what it was asked."""

    out: Path
    checkpoints: list[Checkpoint]
    methods: list[Method]
    sets: dict[str, list[TestSet]]  # checkpoint label -> its test sets
    cells: list[Cell]
    samples: int
    buckets: list[int] | None  # None: each checkpoint's eval.length_buckets
    skipped: dict[str, list[str]] = field(default_factory=dict)  # method -> checkpoints it does not apply to

    def edges(self, checkpoint: Checkpoint) -> list[int]:
        return sorted(self.buckets if self.buckets is not None else checkpoint.cfg.eval.length_buckets)


def make_plan(
    out: Path,
    checkpoints: Sequence[tuple[Path, str, str, int | None]],
    methods: list[Method],
    sets: SetSpec,
    samples: int = 1000,
    beam: int | None = None,
    buckets: list[int] | None = None,
    explicit: bool = True,
    device: str = "cpu",
) -> Plan:
    """Load every checkpoint, check every method on it and build every test set: all errors here, before
    any decoding. ``checkpoints``: (export, label, group, seed). ``explicit``: the methods were named, and
    one that no checkpoint can take is an error (else it is left out). ``device``: the kind of device that
    decodes (``cpu``, ``cuda``), part of what a kept cell must match: the baseline and a method of one
    checkpoint are decoded on the same kind, so that their difference is the method's."""
    if samples < 1:
        raise StudyError(f"--samples must be at least 1, got {samples}")
    if beam is not None and beam < 1:
        raise StudyError(f"--beam must be at least 1, got {beam}")
    if buckets is not None and (not buckets or min(buckets) < 1 or len(set(buckets)) != len(buckets)):
        raise StudyError(f"--buckets {buckets}: give increasing source lengths in words, e.g. 8,16,24,32")
    if not checkpoints:
        raise StudyError("no checkpoint: give a study directory or --checkpoint PATH (repeatable)")
    loaded: list[Checkpoint] = []
    cache: dict[str, list[TestSet]] = {}
    by_label: dict[str, list[TestSet]] = {}
    cells: list[Cell] = []
    takers: dict[str, list[str]] = {m.name: [] for m in methods}
    for path, label, group, seed in checkpoints:
        ckpt, (model, cfg, _) = load_checkpoint(path, label, group, seed)
        loaded.append(ckpt)
        for method in methods:  # each applicable method on a copy: bad values stop here
            if not ckpt.takes(method):
                continue
            takers[method.name].append(ckpt.label)
            if method.family != BASELINE:
                try:
                    apply_position_settings(copy.deepcopy(model), method.items(cfg), cfg.data.max_len + 1)
                except ValueError as err:
                    raise StudyError(f"method {method.name} on checkpoint {ckpt.label}: {err}") from None
        del model
        data_key = cfg.data.model_dump_json()
        if data_key not in cache:
            cache[data_key] = sets.build(cfg)
        by_label[ckpt.label] = cache[data_key]
    unused = [m for m in methods if not takers[m.name]]
    if unused and explicit:
        named = {(m.family if m.family != "custom" else m.name): m for m in unused}
        raise StudyError(
            "; ".join(
                f"method {name} changes {', '.join(sorted(m.encodings()))}"
                + ("" if m.family != "custom" and m.side == "both" else f" ({', '.join(m.sides())})")
                for name, m in named.items()
            )
            + ", which no checkpoint uses there: "
            + "; ".join(f"{c.label} uses {c.describe()} ({_valid(c)})" for c in loaded)
            + ". Name methods of these encodings in --methods, or leave --methods out (every method that "
            "applies)"
        )
    methods = [m for m in methods if takers[m.name]]
    for ckpt in loaded:
        ecfg = ckpt.cfg.eval.model_copy(update={"beam": beam} if beam is not None else {})
        decoding = {**asdict(DecodeOptions.of(ecfg)), "device": device}
        for method in methods:
            if not ckpt.takes(method):
                continue
            for test in by_label[ckpt.label]:
                directory = out / "cells" / ckpt.label / _safe(method.name) / _safe(test.name)
                cells.append(Cell(ckpt, method, method.items(ckpt.cfg), test, directory, decoding))
    skipped = {m.name: [c.label for c in loaded if c.label not in takers[m.name]] for m in methods}
    plan = Plan(out, loaded, methods, by_label, cells, samples, buckets)
    plan.skipped = {k: v for k, v in skipped.items() if v}
    return plan


def _valid(ckpt: Checkpoint) -> str:
    kinds = set(ckpt.encodings().values())
    names = [n for n, f in FAMILIES.items() if f.encoding in kinds]
    return "methods: " + (", ".join(names) if names else "none, only the baseline")


# ---------------------------------------------------------------------------------------------------
# Decoding


def run_plan(plan: Plan, device: torch.device, say: Print = print, dry_run: bool = False) -> tuple[int, int]:
    """Decode every cell not kept yet, checkpoint by checkpoint and method by method (one model copy
    with its settings per method), each checkpoint with its ``train.threads``; returns (decoded, kept
    already). This process's torch thread count is restored at the end."""
    decoded = kept = 0
    threads = torch.get_num_threads()
    try:
        for ckpt in plan.checkpoints:
            mine = [c for c in plan.cells if c.checkpoint is ckpt]
            todo = [c for c in mine if not c.done()]
            done = len(mine) - len(todo)
            kept += done
            say(f"{ckpt.label} ({ckpt.describe()}, {ckpt.path}): {len(mine)} cells, {done} kept")
            if dry_run:
                for c in todo:
                    settings = " ".join(c.items) or "as trained"
                    say(f"  would decode {c.method.name} on {c.test_set.name}: {settings}")
            elif todo:
                decoded += _decode(ckpt, todo, device, say)
    finally:
        torch.set_num_threads(threads)
    return decoded, kept


def _decode(ckpt: Checkpoint, todo: list[Cell], device: torch.device, say: Print) -> int:
    """Decode and keep ``todo``, the cells of one checkpoint."""
    model, cfg, tok = load_export(ckpt.path)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    ecfg = cfg.eval.model_copy(update={"beam": todo[0].decoding["beam"]})
    for method in dict.fromkeys(c.method for c in todo):
        changed = copy.deepcopy(model)
        apply_position_settings(changed, _items(todo, method), cfg.data.max_len + 1)
        changed.to(device)
        for cell in (c for c in todo if c.method == method):
            test = cell.test_set
            result = evaluate(changed, tok, [test], ecfg, cfg.data.tgt_lang).sets[0]
            sources = [s for s, _ in test.pairs]
            figures = {
                **result.figures,
                "extrapolate": cell.key(),
                "checkpoint": str(ckpt.path),
                "method": method.name,
                "source_words": [len(s.split()) for s in sources],
                "untranslated": result.untranslated,
            }
            cell.files.write(Evaluation([result]), figures)
            say(f"  {method.name} on {test.name}: BLEU {result.figures['bleu']:.2f}")
        del changed
    return len(todo)


def _items(cells: list[Cell], method: Method) -> list[str]:
    return next(c.items for c in cells if c.method == method)


# ---------------------------------------------------------------------------------------------------
# Scoring the kept cells


def bucket_order(name: str) -> int:
    return -1 if name == ALL else bucket_low(name)


@dataclass
class BucketTests:
    """One bucket of one row: the paired test of the method against the baseline (the baseline row:
    against itself, which gives its confidence interval), per checkpoint and pooled over the row's
    checkpoints (their sentences one after the other, each paired with its own checkpoint's baseline)."""

    sentences: int
    untranslated: int  # of the method's hypotheses: sources longer than the encoding can represent
    length_ratio: float  # the method's hypotheses over the references, pooled (metrics.length_ratio)
    per_checkpoint: dict[str, PairedResult]
    pooled: PairedResult

    def figure(self, key: str) -> dict[str, float]:
        """``bleu`` or ``chrf`` of the pooled test: score, bootstrap mean, 95% interval, delta, p."""
        m = self.pooled.metrics[key]
        return {
            "score": m.system,
            "mean": m.system_mean,
            "ci95": m.system_ci,
            "low": m.system_mean - m.system_ci,
            "high": m.system_mean + m.system_ci,
            "baseline": m.baseline,
            "delta": m.delta,
            "p_value": m.p_value,
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "sentences": self.sentences,
            "untranslated": self.untranslated,
            "length_ratio": self.length_ratio,
            "bleu": self.figure("bleu"),
            "chrf": self.figure("chrf"),
            "per_checkpoint": {label: r.as_dict() for label, r in self.per_checkpoint.items()},
            "pooled": self.pooled.as_dict(),
        }


@dataclass
class MethodRow:
    """A method on one test set for one group (a setting's seeds, or one checkpoint)."""

    test_set: str
    group: str
    method: Method
    checkpoints: list[str]
    buckets: dict[str, BucketTests]  # ALL first, then by length


@dataclass
class Outcome:
    """What the report is written from."""

    plan: Plan
    rows: list[MethodRow]
    cap: int | None  # the longest training source sentence in words, when the corpus bounds it
    decoded: int = 0
    kept: int = 0

    def sets(self) -> list[str]:
        return list(dict.fromkeys(r.test_set for r in self.rows))

    def groups(self) -> list[str]:
        return list(dict.fromkeys(r.group for r in self.rows))

    def buckets(self, test_set: str) -> list[str]:
        names = {b for r in self.rows if r.test_set == test_set for b in r.buckets}
        return sorted(names, key=bucket_order)


def score(plan: Plan) -> list[MethodRow]:
    """Every row's bucket tests from the kept cells (no decoding)."""
    kept: dict[tuple[str, str, str], tuple[list[str], list[str], dict[str, Any]]] = {}
    for cell in plan.cells:
        pair = cell.files.read_set(cell.test_set.name)
        figures = cell.files.read_figures()
        if pair is None or figures is None or not cell.done():
            raise StudyError(f"cell {cell.directory} is not decoded; run the same command without --dry-run")
        kept[cell.checkpoint.label, cell.method.name, cell.test_set.name] = (*pair, figures)
    rows: list[MethodRow] = []
    order = [(c.test_set.name, c.checkpoint.group, c.method) for c in plan.cells]
    for test_name, group, method in sorted(dict.fromkeys(order), key=lambda k: _row_order(plan, *k)):
        members = [
            c for c in plan.checkpoints if c.group == group and (c.label, method.name, test_name) in kept
        ]
        split: dict[str, dict[str, tuple[list[str], list[str], list[str], int]]] = {}
        for ckpt in members:
            hyps, refs, figures = kept[ckpt.label, method.name, test_name]
            base, base_refs, _ = kept[ckpt.label, BASELINE, test_name]
            if base_refs != refs:
                raise StudyError(
                    f"{ckpt.label}: the kept references of {method.name} and the baseline on {test_name} "
                    "differ; delete the cells of this checkpoint and run again"
                )
            lost = set(figures["untranslated"])
            names = [length_bucket(w, plan.edges(ckpt)) for w in figures["source_words"]]
            for bucket in [ALL, *dict.fromkeys(names)]:
                idx = [i for i, n in enumerate(names) if bucket in (ALL, n)]
                parts = split.setdefault(bucket, {})
                parts[ckpt.label] = ([hyps[i] for i in idx], [base[i] for i in idx], [refs[i] for i in idx],
                                     sum(i in lost for i in idx))  # fmt: skip
        buckets = {}
        for bucket in sorted(split, key=bucket_order):
            per = {
                label: paired_bootstrap(s, b, r, plan.samples)
                for label, (s, b, r, _) in split[bucket].items()
            }
            joined: tuple[list[str], list[str], list[str]] = ([], [], [])
            for s, b, r, _ in split[bucket].values():
                for part, lines in zip(joined, (s, b, r), strict=True):
                    part.extend(lines)
            pooled = next(iter(per.values())) if len(per) == 1 else paired_bootstrap(*joined, plan.samples)
            lost_n = sum(n for *_, n in split[bucket].values())
            ratio = length_ratio(joined[0], joined[2])
            buckets[bucket] = BucketTests(len(joined[2]), lost_n, ratio, per, pooled)
        rows.append(MethodRow(test_name, group, method, [c.label for c in members], buckets))
    return rows


def _row_order(plan: Plan, test_name: str, group: str, method: Method) -> tuple[int, int, int]:
    sets = list(dict.fromkeys(t.name for sets in plan.sets.values() for t in sets))
    groups = list(dict.fromkeys(c.group for c in plan.checkpoints))
    return sets.index(test_name), groups.index(group), plan.methods.index(method)
