"""The study's figures: BLEU per setting, BLEU against source length, word-order probe accuracy, and
the cosine similarity between positions of the sinusoidal and learned tables. Each is written as a PNG
and as a TensorBoard image (``report/tb``: ``tensorboard --logdir STUDY_DIR/report/tb``).

Figures are built with matplotlib's object API (``matplotlib.figure.Figure``, Agg canvas): no pyplot
state, no display needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from tpe_train.positions.absolute import sinusoid_table
from tpe_train.study.extrapolate import ALL, Outcome
from tpe_train.study.grid import Setting, Study
from tpe_train.study.results import FIGURES, Row, Run, bucket_low, bucket_names, run_config, training_cap


def _bars(ax: Axes, rows: list[Row], key: str, scale: float) -> None:
    """Mean per setting with the sample standard deviation as error bar, and every seed as a dot."""
    names = [r.setting.name for r in rows]
    means = [scale * r.figures[key].mean if r.figures[key].values else math.nan for r in rows]
    sds = [scale * (r.figures[key].sd or 0.0) if r.figures[key].values else 0.0 for r in rows]
    x = list(range(len(rows)))
    ax.bar(x, means, yerr=sds, capsize=4, color="#8fb3d9", edgecolor="#2b5d8a")
    for i, row in enumerate(rows):
        seeds = [scale * v for v in row.figures[key].values]
        ax.scatter([i] * len(seeds), seeds, color="#1b1b1b", s=12, zorder=3)
    ax.set_xticks(x, names, rotation=30, ha="right")
    ax.grid(axis="y", alpha=0.3)


def bleu_figure(rows: list[Row]) -> Figure:
    fig = Figure(figsize=(max(5.0, 0.9 * len(rows) + 2), 4), layout="constrained")
    ax = fig.add_subplot()
    _bars(ax, rows, "bleu", 1.0)
    ax.set_ylabel("BLEU (sacreBLEU, test)")
    ax.set_title("BLEU per setting (mean ± sd over seeds; dots: seeds)")
    return fig


def probe_figure(rows: list[Row]) -> Figure:
    fig = Figure(figsize=(max(5.0, 0.9 * len(rows) + 2), 4), layout="constrained")
    ax = fig.add_subplot()
    _bars(ax, rows, "probe_accuracy", FIGURES["probe_accuracy"][1])
    ax.set_ylim(0, 105)
    ax.set_ylabel("minimal pairs both translated exactly (%)")
    ax.set_title("Word-order probe accuracy (mean ± sd over seeds)")
    return fig


@dataclass
class Series:
    """One line of a score-against-length plot: a value and an error bar per bucket (NaN: no value),
    and the buckets it could not translate at all (annotated at the foot of the axes)."""

    label: str
    values: list[float]
    errors: list[float]
    too_long: set[str] = field(default_factory=set)


def length_axes(
    ax: Axes, buckets: list[str], cap: int | None, series: list[Series], ylabel: str, legend: bool = True
) -> None:
    """Score per source-length bucket, one line per series; buckets beyond training (``cap`` words) shaded."""
    x = list(range(len(buckets)))
    beyond = [i for i, b in enumerate(buckets) if cap is not None and bucket_low(b) > cap]
    if beyond:
        ax.axvspan(
            beyond[0] - 0.5,
            len(buckets) - 0.5,
            color="#f2e3c9",
            label=f"longer than training (> {cap} words)",
        )
    for one in series:
        line = ax.errorbar(x, one.values, yerr=one.errors, marker="o", capsize=3, label=one.label)
        for i, b in enumerate(buckets):  # at the foot of the axes, in the series' colour
            if b in one.too_long:
                ax.annotate(
                    f"{one.label}: too long",
                    (i, 0.02),
                    xycoords=("data", "axes fraction"),
                    fontsize=7,
                    rotation=90,
                    ha="center",
                    va="bottom",
                    color=line[0].get_color(),
                )
    ax.set_xticks(x, buckets)
    ax.set_xlim(-0.5, len(buckets) - 0.5)
    ax.set_xlabel("source length (words)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=8, loc="best")


def length_figure(rows: list[Row], runs: list[Run]) -> Figure:
    """BLEU per source-length bucket, one line per setting; buckets beyond training shaded."""
    buckets = bucket_names(runs)
    fig = Figure(figsize=(max(6.0, 1.1 * len(buckets) + 3), 4.5), layout="constrained")
    ax = fig.add_subplot()
    series = [
        Series(
            row.setting.name,
            [row.buckets[b].mean if row.buckets[b].values else math.nan for b in buckets],
            [row.buckets[b].sd or 0.0 for b in buckets],
            {b for b in buckets if b in row.too_long and not row.buckets[b].values},
        )
        for row in rows
    ]
    length_axes(ax, buckets, training_cap(runs), series, "BLEU")
    ax.set_title("BLEU against source length (mean ± sd over seeds)")
    return fig


def _cosine(table: torch.Tensor) -> torch.Tensor:
    """(L, d) rows -> (L, L) cosine similarity between positions."""
    unit = torch.nn.functional.normalize(table.double(), dim=1)
    return unit @ unit.T


def position_tables(
    study: Study, runs: list[Run], positions: int
) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
    """(title, similarity) of the sinusoidal table (at the d_model of a finished run) and the learned
    tables (encoder, decoder) of the first finished seed whose export (or archived tables) has them;
    notes on what could not be drawn."""
    panels: list[tuple[str, torch.Tensor]] = []
    notes: list[str] = []
    for kind in ("sinusoidal", "learned"):
        if kind not in study.settings:
            continue
        mine = [r for r in runs if r.setting == Setting(kind) and r.metrics is not None]
        if kind == "sinusoidal":  # computed, never stored: rebuilt from the run's d_model
            cfg = next((c for c in map(run_config, mine) if c is not None), None)
            if cfg is None:
                notes.append("no finished `sinusoidal` run yet: its position-similarity heat map is missing")
                continue
            table = sinusoid_table(torch.arange(positions), cfg.model.d_model)
            panels.append((f"sinusoidal (d={cfg.model.d_model})", _cosine(table)))
            continue
        found = [(r, t) for r, t in ((r, r.learned_tables()) for r in mine) if t is not None]
        if not found:
            notes.append(f"no exported `{kind}` checkpoint yet: its position-similarity heat map is missing")
            continue
        run, weights = found[0]  # the final export written by tpe-train, or its archived tables
        for side in ("encoder", "decoder"):
            key = f"{side}.positions.0.table.weight"
            if key in weights:
                rows = min(positions, weights[key].shape[0])
                panels.append((f"learned, {side} (seed {run.seed})", _cosine(weights[key][:rows])))
    return panels, notes


def similarity_figure(panels: list[tuple[str, torch.Tensor]]) -> Figure:
    fig = Figure(figsize=(4.2 * len(panels) + 0.8, 4.2), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    image = None
    for ax, (title, sim) in zip(axes, panels, strict=True):
        image = ax.imshow(sim.numpy(), vmin=-1.0, vmax=1.0, cmap="RdBu_r", origin="upper")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("position j")
        ax.set_ylabel("position i")
    assert image is not None
    fig.colorbar(image, ax=list(axes), shrink=0.8, label="cosine similarity")
    fig.suptitle("Similarity between positions of the position table")
    return fig


def make_figures(
    study: Study, runs: list[Run], rows: list[Row], heatmap_positions: int
) -> tuple[dict[str, Figure], list[str]]:
    """The study's figures by file stem, and notes on the ones that cannot be drawn (yet)."""
    figures: dict[str, Figure] = {}
    notes: list[str] = []
    if not any(row.figures["bleu"].values for row in rows):
        return figures, ["no run has figures yet: no plots"]
    figures["bleu_per_encoding"] = bleu_figure(rows)
    if bucket_names(runs):
        figures["bleu_by_length"] = length_figure(rows, runs)
    if any(row.figures["probe_accuracy"].values for row in rows):
        figures["probe_accuracy"] = probe_figure(rows)
    else:
        notes.append("the corpus has no word-order probes (synthetic corpus only): no probe plot")
    panels, table_notes = position_tables(study, runs, heatmap_positions)
    notes += table_notes
    if panels:
        figures["position_similarity"] = similarity_figure(panels)
    elif not table_notes:
        notes.append("the study has neither `sinusoidal` nor `learned`: no position-similarity heat map")
    return figures, notes


def write_figures(figures: dict[str, Figure], out: Path, tb_dir: Path, text: str) -> list[Path]:
    """Each figure as ``out/<stem>.png`` and as the TensorBoard image ``study/<stem>`` (with the report
    text as ``study/report``); the previous report's events are replaced."""
    from torch.utils.tensorboard import SummaryWriter

    tb_dir.mkdir(parents=True, exist_ok=True)
    for old in tb_dir.glob("events.out.tfevents.*"):  # a re-gathered report replaces the last one
        old.unlink()
    paths = []
    writer = SummaryWriter(str(tb_dir))
    try:
        for stem, fig in figures.items():
            path = out / f"{stem}.png"
            fig.savefig(path, dpi=110)
            paths.append(path)
            writer.add_figure(f"study/{stem}", fig, global_step=0, close=True)
        writer.add_text("study/report", text, global_step=0)
    finally:
        writer.close()
    return paths


def extrapolation_figure(outcome: Outcome, group: str) -> Figure:
    """One group's (a setting's seeds, or one checkpoint) scores against source length: BLEU above,
    chrF below, one column per test set, one line per method; error bars: the bootstrap 95% half-width
    (pooled over the group's checkpoints)."""
    sets = [s for s in outcome.sets() if any(r.group == group and r.test_set == s for r in outcome.rows)]
    widths = [len([b for b in outcome.buckets(s) if b != ALL]) for s in sets]
    fig = Figure(figsize=(sum(max(4.0, 0.9 * w + 2) for w in widths), 7.5), layout="constrained")
    axes = fig.subplots(2, len(sets), squeeze=False)
    for column, test_set in enumerate(sets):
        buckets = [b for b in outcome.buckets(test_set) if b != ALL]
        rows = [r for r in outcome.rows if r.group == group and r.test_set == test_set]
        for line, (key, label) in enumerate((("bleu", "BLEU"), ("chrf", "chrF"))):
            series = []
            for row in rows:
                tests = [row.buckets.get(b) for b in buckets]
                series.append(
                    Series(
                        row.method.name,
                        [t.figure(key)["score"] if t is not None else math.nan for t in tests],
                        [t.figure(key)["ci95"] if t is not None else 0.0 for t in tests],
                        {
                            b
                            for b, t in zip(buckets, tests, strict=True)
                            if t and t.untranslated == t.sentences
                        },
                    )
                )
            ax = axes[line][column]
            length_axes(ax, buckets, outcome.cap, series, label, legend=(line, column) == (0, 0))
            ax.set_title(f"{test_set}: {label}", fontsize=10)
    shaded = f"; shaded: longer than training (> {outcome.cap} words)" if outcome.cap is not None else ""
    fig.suptitle(f"{group}: score against source length per method (± bootstrap 95% half-width{shaded})")
    return fig
