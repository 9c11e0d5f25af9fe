"""Gathering a study: every run's ``eval.json`` -> mean and standard deviation over seeds -> a markdown
table (``report/report.md``), ``report/summary.json``, and the plots of ``plots``.

``tpe-study report STUDY_DIR`` does only this, so a study can be re-gathered at any time (while a Slurm
array still runs, the runs without figures are listed as missing).
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tpe_train.config import Config, validate
from tpe_train.study.grid import Setting, Study, parse_setting

#: The headline figures of eval.json: key -> (column, scale for display, unit).
FIGURES = {
    "bleu": ("BLEU", 1.0, ""),
    "chrf": ("chrF", 1.0, ""),
    "exact_match": ("exact match", 100.0, "%"),
    "probe_accuracy": ("word-order probe", 100.0, "%"),
    "bleu_tokenized": ("BLEU tok.+compound", 1.0, ""),
}


@dataclass
class Run:
    """One cell of the grid and its figures (``None``: not there yet, or failed)."""

    setting: Setting
    seed: int
    run_dir: Path
    eval_path: Path
    metrics: dict[str, Any] | None

    def wall(self) -> tuple[float, float, float] | None:
        """(seconds its processes ran, first start, last end) as ``<run_dir>/study.log`` recorded them:
        training and evaluation, summed over a resumed run's processes; None without a finished one."""
        log = self.run_dir / "study.log"
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


def duration(seconds: float) -> str:
    """``4 h 05 min``, ``12 min``, ``45 s``."""
    minutes = round(seconds / 60)
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"


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
        path = study.eval_path(setting, seed)
        metrics = json.loads(path.read_text()) if path.is_file() else None
        runs.append(Run(setting, seed, study.run_dir(setting, seed), path, metrics))
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
    path = run.run_dir / "config.yaml"
    return validate(yaml.safe_load(path.read_text())) if path.is_file() else None


def training_cap(runs: list[Run]) -> int | None:
    """The longest training source sentence in words, when the corpus bounds it (synthetic:
    ``data.synthetic.max_words``; real corpora: ``data.clean.max_words``); None when unknown."""
    for run in runs:
        cfg = run_config(run)
        if cfg is not None:
            d = cfg.data
            return d.synthetic.max_words if d.corpus == "synthetic" else d.clean.max_words
    return None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def markdown(study: Study, runs: list[Run], rows: list[Row], plots: list[Path], notes: list[str]) -> str:
    """The report: what was run, the table, the plots, every run and what is missing."""
    buckets = bucket_names(runs)
    cap = training_cap(runs)
    beyond = {b for b in buckets if cap is not None and bucket_low(b) > cap}
    shown = [k for k in FIGURES if any(row.figures[k].values for row in rows)]
    done = [r for r in runs if r.metrics is not None]
    signature = next((r.metrics.get("bleu_signature") for r in done if r.metrics), None)
    method = next((r.metrics.get("bleu_tokenized_method") for r in done if r.metrics), None)
    lines = [
        f"# Position-encoding study: preset `{study.preset}`",
        "",
        f"{_count(len(study.settings), 'setting')} x {_count(len(study.seeds), 'seed')} "
        f"({', '.join(map(str, study.seeds))}); "
        f"{len(done)} of {len(runs)} runs have figures. Overrides: "
        + (" ".join(f"`{o}`" for o in study.overrides) or "none")
        + ".",
        "",
        "Each cell is the mean ± sample standard deviation over the seeds present (a single seed: its value)"
        + (
            f", of the model averaged over the last {study.average} checkpoints."
            if study.average
            else ", of the final model."
        ),
        "BLEU and chrF are sacreBLEU on the detokenized test set"
        + (f" (`{signature}`)" if signature else "")
        + "; length buckets are BLEU over test sentences (and the extrapolation set) by source words.",
    ]
    if method:
        lines.append(
            f"BLEU tok.+compound is the papers' tokenized BLEU (`{method}`): Moses tokenization and "
            "`##AT##-##AT##` compound splitting on both sides, then multi-bleu; set it beside published "
            "En-De figures, never beside sacreBLEU."
        )
    if beyond:
        lines.append(
            f"Training source sentences have at most {cap} words: buckets marked † hold only longer "
            "sentences (length extrapolation)."
        )
    header = [
        "setting",
        "seeds",
        *(FIGURES[k][0] for k in shown),
        *(b + (" †" if b in beyond else "") for b in buckets),
    ]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    footnotes = False
    for row in rows:
        cells = [f"`{row.setting.name}`", str(len(row.seeds))]
        cells += [row.figures[k].text(FIGURES[k][1], FIGURES[k][2]) for k in shown]
        for b in buckets:
            stat = row.buckets[b]
            cell = stat.text() if stat.values else ("too long" if b in row.too_long else "n/a")
            if b in row.too_long and stat.values:
                cell += "*"
                footnotes = True
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    if footnotes or any(row.too_long for row in rows):
        lines += ["", "too long: every sentence of the bucket is longer than the encoding can represent (a "
                  "learned table of `model.position.max_positions` rows); reported, not translated. *: some "
                  "were left out for that reason; the BLEU is over the rest."]  # fmt: skip
    lines += ["", "## Settings", ""]
    lines += [f"- `{row.setting.name}`: {row.setting.describe()}" for row in rows]
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{p.stem.replace('_', ' ')}]({p.name})" for p in plots]
    if notes:
        lines += ["", *(f"- {n}" for n in notes)]
    lines += ["", "## Runs", "", "| setting | seed | BLEU | wall | figures |", "|---|---|---|---|---|"]
    walls = [w for w in (r.wall() for r in runs) if w is not None]
    for r in runs:
        where = r.eval_path.relative_to(study.root) if r.eval_path.is_relative_to(study.root) else r.eval_path
        bleu = f"{r.metrics['bleu']:.2f}" if r.metrics else "missing"
        wall = r.wall()
        lines.append(
            f"| `{r.setting.name}` | {r.seed} | {bleu} | {duration(wall[0]) if wall else 'n/a'} | `{where}` |"
        )
    if walls:
        total, span = sum(w[0] for w in walls), max(w[2] for w in walls) - min(w[1] for w in walls)
        lines += [
            "",
            f"Wall time (training and evaluation of each run, from its `study.log`): {duration(total)} for "
            f"{_count(len(walls), 'run')} together; {duration(span)} from the first start to the last end.",
        ]
    missing = [r for r in runs if r.metrics is None]
    if missing:
        lines += [
            "",
            f"{len(missing)} runs have no figures yet (still running, failed or not started); "
            "`tpe-study run` with the same arguments runs them, `tpe-study report` gathers again.",
        ]
    return "\n".join(lines) + "\n"


def summary(study: Study, rows: list[Row]) -> dict[str, Any]:
    """The aggregated figures as JSON (``report/summary.json``)."""
    return {
        "preset": study.preset,
        "overrides": study.overrides,
        "seeds": study.seeds,
        "average": study.average,
        "settings": {
            row.setting.name: {
                "seeds": row.seeds,
                **{k: stat.as_dict() for k, stat in row.figures.items()},
                "bleu_by_length": {b: stat.as_dict() for b, stat in row.buckets.items()},
                "too_long": row.too_long,
            }
            for row in rows
        },
    }


def write_report(study: Study, heatmap_positions: int = 128) -> Path:
    """Gather the study and write ``report/`` (markdown, summary, PNG plots, TensorBoard images)."""
    from tpe_train.study.plots import make_figures, write_figures

    runs = gather(study)
    rows = aggregate(study, runs)
    out = study.report_dir
    out.mkdir(parents=True, exist_ok=True)
    figures, notes = make_figures(study, runs, rows, heatmap_positions)
    text_without_plots = markdown(study, runs, rows, [], notes)
    plots = write_figures(figures, out, out / "tb", text_without_plots)
    path = out / "report.md"
    path.write_text(markdown(study, runs, rows, plots, notes))
    (out / "summary.json").write_text(json.dumps(summary(study, rows), indent=2) + "\n")
    return path
