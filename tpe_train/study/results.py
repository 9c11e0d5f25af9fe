"""What a study's report is built from, shared by ``report`` and ``plots``: every run's figures
(``Run``), their means and deviations over seeds per setting (``Row``, ``Stat``), and the paired
bootstrap tests of every setting against the study's baseline setting (``SettingTests``), per seed and
pooled over seeds, from the test hypotheses each evaluation kept (no decoding here)."""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from safetensors.torch import load_file
from torch import Tensor

from tpe_train.ckpt.export import WEIGHTS
from tpe_train.ckpt.rundir import RunDir
from tpe_train.config import Config, legacy, validate
from tpe_train.evaluation.decoding import read_lines
from tpe_train.evaluation.evaluate import EvalFiles
from tpe_train.evaluation.metrics import PairedResult, paired_bootstrap
from tpe_train.study.grid import RUN_LOG, Setting, Study, parse_setting

#: The headline figures of eval.json: key -> (column, scale for display, unit).
FIGURES = {
    "bleu": ("BLEU", 1.0, ""),
    "chrf": ("chrF", 1.0, ""),
    "exact_match": ("exact match", 100.0, "%"),
    "probe_accuracy": ("word-order probe", 100.0, "%"),
    "bleu_tokenized": ("BLEU tok.+compound", 1.0, ""),
    "bleu_lc_tokenized": ("BLEU lc tok.", 1.0, ""),
}


#: In an archived run directory (``tpe-study archive``): the learned position tables of its export.
POSITION_TABLES = "positions.safetensors"


def position_tables_of(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """The learned absolute position tables among a model's weights (``*.positions.<i>.table.weight``)."""
    return {k: v for k, v in weights.items() if ".positions." in k and k.endswith(".table.weight")}


@dataclass
class Run:
    """One cell of the grid and its figures (``None``: not there yet, or failed)."""

    setting: Setting
    seed: int
    run_dir: Path
    eval_path: Path
    metrics: dict[str, Any] | None

    def learned_tables(self) -> dict[str, Tensor] | None:
        """The learned position tables of the final export, or of the archive's copy; None if neither."""
        export = RunDir(self.run_dir).export / WEIGHTS
        if export.is_file():
            return position_tables_of(load_file(str(export)))
        archived = self.run_dir / POSITION_TABLES
        return load_file(str(archived)) if archived.is_file() else None

    def wall(self) -> tuple[float, float, float] | None:
        """(seconds its processes ran, first start, last end) as ``<run_dir>/study.log`` recorded them:
        training and evaluation, summed over a resumed run's processes; None without a finished one."""
        log = self.run_dir / RUN_LOG
        stamps = _STAMP.findall(log.read_text(errors="replace")) if log.is_file() else []
        spans, start = [], None
        for kind, unix in stamps:
            if kind == "started":
                start = float(unix)
            elif start is not None:
                spans.append((start, float(unix)))
                start = None
        if not spans:
            return None
        return sum(b - a for a, b in spans), spans[0][0], spans[-1][1]


#: The lines tpe-study writes around each process of a run (``runner.run_logged``).
_STAMP = re.compile(r"^# (started|exit -?\d+ at) .*\(unix ([0-9.]+)\)$", re.M)


@dataclass
class Stat:
    """Mean and sample standard deviation of the values one figure took over seeds."""

    values: list[float]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def sd(self) -> float | None:
        return statistics.stdev(self.values) if len(self.values) > 1 else None

    def text(self, scale: float = 1.0, unit: str = "") -> str:
        if not self.values:
            return "n/a"
        sd = self.sd
        spread = f" ± {scale * sd:.1f}" if sd is not None else ""
        return f"{scale * self.mean:.1f}{unit}{spread}"

    def as_dict(self) -> dict[str, Any]:
        return {"mean": self.mean if self.values else None, "sd": self.sd, "n": len(self.values)}


@dataclass
class Row:
    """The figures of one setting over its seeds."""

    setting: Setting
    seeds: list[int]
    figures: dict[str, Stat] = field(default_factory=dict)
    buckets: dict[str, Stat] = field(default_factory=dict)
    too_long: dict[str, int] = field(default_factory=dict)  # bucket -> sentences left out (max over seeds)


def gather(study: Study) -> list[Run]:
    """Every run of the grid, with its figures where they exist."""
    runs = []
    for setting, seed in study.grid():
        files = study.eval_files(setting, seed)
        runs.append(Run(setting, seed, study.run_dir(setting, seed), files.figures, files.read_figures()))
    return runs


def aggregate(study: Study, runs: list[Run]) -> list[Row]:
    """One row per setting (in the study's order) with means and deviations over the seeds present."""
    rows = []
    for name in study.settings:
        setting = parse_setting(name)
        done = [r for r in runs if r.setting == setting and r.metrics is not None]
        row = Row(setting, [r.seed for r in done])
        figures = [r.metrics for r in done if r.metrics is not None]
        for key in FIGURES:
            row.figures[key] = Stat([m[key] for m in figures if m.get(key) is not None])
        for name_ in bucket_names(runs):
            values, left_out = [], 0
            for r in done:
                entry = (r.metrics or {}).get("bleu_by_length", {}).get(name_)
                if entry is None:
                    continue
                if entry["bleu"] is None:
                    left_out = max(left_out, entry["sentences"])
                else:
                    values.append(entry["bleu"])
                    left_out = max(left_out, entry.get("unrepresentable", 0))
            row.buckets[name_] = Stat(values)
            if left_out:
                row.too_long[name_] = left_out
        rows.append(row)
    return rows


def bucket_names(runs: list[Run]) -> list[str]:
    """The length buckets of the study's runs, shortest first."""
    names: dict[str, None] = {}
    for r in runs:
        for name in (r.metrics or {}).get("bleu_by_length", {}):
            names[name] = None
    return sorted(names, key=lambda n: int(n.rstrip("+").split("-")[0]))


def bucket_low(name: str) -> int:
    """The shortest source length (words) of a bucket named ``lo-hi`` or ``lo+``."""
    return int(name.rstrip("+").split("-")[0])


def run_config(run: Run) -> Config | None:
    path = RunDir(run.run_dir).config
    return validate(legacy.fill(yaml.safe_load(path.read_text()))) if path.is_file() else None


def training_cap(runs: list[Run]) -> int | None:
    """The longest training source sentence in words of the first run with a config (``config_cap``)."""
    for run in runs:
        cfg = run_config(run)
        if cfg is not None:
            return config_cap(cfg)
    return None


def config_cap(cfg: Config) -> int | None:
    """The longest training source sentence in words, when the corpus bounds it (synthetic:
    ``data.synthetic.max_words``; real corpora: ``data.clean.max_words``); None when unknown."""
    d = cfg.data
    return d.synthetic.max_words if d.corpus == "synthetic" else d.clean.max_words


@dataclass
class SettingTests:
    """Paired bootstrap tests of one setting's test hypotheses against the baseline setting's: per seed
    (each run against the baseline's run of that seed) and pooled (the seeds' test sets one after the
    other, every sentence paired with the same seed's baseline sentence, resampled together)."""

    setting: Setting
    baseline: Setting
    per_seed: dict[int, PairedResult] = field(default_factory=dict)
    pooled: PairedResult | None = None
    missing: list[int] = field(default_factory=list)  # seeds without kept hypotheses on either side
    unpaired: list[int] = field(default_factory=list)  # seeds the setting has and the baseline does not

    def as_dict(self) -> dict[str, Any]:
        return {
            "baseline": self.baseline.name,
            "per_seed": {str(seed): r.as_dict() for seed, r in self.per_seed.items()},
            "pooled": self.pooled.as_dict() if self.pooled is not None else None,
            "seeds_without_hypotheses": self.missing,
            "seeds_without_baseline": self.unpaired,
        }


def test_set(run: Run) -> str | None:
    """The name of the test set a finished run was evaluated on (None: not finished, or unknown)."""
    if run.metrics is None:
        return None
    name = run.metrics.get("test_set")
    if name is None:  # evaluated before the set was named: the config's test split
        cfg = run_config(run)
        name = cfg.data.test_split if cfg is not None else None
    return str(name) if name is not None else None


def kept_hypotheses(run: Run) -> tuple[list[str], list[str] | None] | None:
    """(hypotheses, references) of the run's test set as its evaluation kept them, or None. The
    references are None where they were not kept (an archive leaves the test set out)."""
    name = test_set(run)
    if name is None:
        return None
    files = EvalFiles(run.eval_path.parent)
    hyp, ref = files.hypotheses(name), files.references(name)
    if not hyp.is_file():
        return None
    return read_lines(hyp), (read_lines(ref) if ref.is_file() else None)


def kept_references(study: Study) -> bool:
    """Whether a finished run of ``study`` kept its test set's references (an archive's runs do not)."""
    return any((kept := kept_hypotheses(run)) is not None and kept[1] is not None for run in gather(study))


def significance(study: Study, runs: list[Run], samples: int = 1000) -> list[SettingTests]:
    """Every setting but the baseline against the baseline (see ``SettingTests``).

    A pair needs the test set's references, which an archive leaves out: where neither run kept
    them, those of any other run of the study on the same test set serve (every run of a study reads
    the same corpus with the same data settings). So runs restored from an archive are tested again
    once one run trained after the restore has evaluated."""
    baseline = parse_setting(study.baseline_setting)
    by_cell = {(r.setting, r.seed): r for r in runs}
    shared: dict[str, list[str]] = {}
    for run in runs:
        kept, name = kept_hypotheses(run), test_set(run)
        if kept is not None and kept[1] is not None and name is not None:
            shared.setdefault(name, kept[1])
    tests = []
    for name in study.settings:
        setting = parse_setting(name)
        if setting == baseline:
            continue
        result = SettingTests(setting, baseline)
        pooled: tuple[list[str], list[str], list[str]] = ([], [], [])
        for seed in study.seeds:
            mine, theirs = (by_cell.get((s, seed)) for s in (setting, baseline))
            if mine is not None and mine.metrics is not None and (theirs is None or theirs.metrics is None):
                result.unpaired.append(seed)  # a seed only this setting has (or its baseline run is not done)
                continue
            if mine is None or theirs is None or mine.metrics is None or theirs.metrics is None:
                continue  # not run yet: listed as missing elsewhere
            a, b = kept_hypotheses(mine), kept_hypotheses(theirs)
            refs = (a[1] or b[1]) if a is not None and b is not None else None  # one side's will do
            if refs is None and a is not None and b is not None and test_set(mine) == test_set(theirs):
                refs = shared.get(test_set(mine) or "")
            if (
                a is None or b is None or refs is None or (None not in (a[1], b[1]) and a[1] != b[1])
            ) or not len(a[0]) == len(b[0]) == len(refs):  # no hypotheses, or not the same references
                result.missing.append(seed)
                continue
            result.per_seed[seed] = paired_bootstrap(a[0], b[0], refs, samples)
            for part, lines in zip(pooled, (a[0], b[0], refs), strict=True):
                part.extend(lines)
        if len(result.per_seed) > 1:
            result.pooled = paired_bootstrap(*pooled, samples)
        elif result.per_seed:
            result.pooled = next(iter(result.per_seed.values()))
        tests.append(result)
    return tests
