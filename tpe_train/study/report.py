"""Gathering a study: every run's ``eval.json`` -> mean and standard deviation over seeds, and the
paired bootstrap test of every setting against the baseline setting -> a markdown table
(``report/report.md``), ``report/summary.json``, and the plots of ``plots``.

``tpe-study report STUDY_DIR`` does only this, so a study can be re-gathered at any time (while a Slurm
array still runs, the runs without figures are listed as missing).

``write_extrapolation_report`` writes the report of ``tpe-study extrapolate`` with the same pieces
(p-values, plots written by ``plots.write_figures``): per test set a BLEU and a chrF table of methods by
length bucket, ``summary.json``, and one score-against-length figure per row group.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any

from tpe_train.ckpt.rundir import RunDir
from tpe_train.evaluation.metrics import PairedResult
from tpe_train.run.outputs import check_output, files_of, written_directory
from tpe_train.study.extrapolate import ALL, BucketTests, Outcome
from tpe_train.study.grid import Study
from tpe_train.study.position_methods import BASELINE
from tpe_train.study.results import (
    FIGURES,
    Row,
    Run,
    SettingTests,
    aggregate,
    bucket_low,
    bucket_names,
    gather,
    significance,
    training_cap,
)


def duration(seconds: float) -> str:
    """``4 h 05 min``, ``12 min``, ``45 s``."""
    minutes = round(seconds / 60)
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _p(p: float) -> str:
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def _versus(test: SettingTests, row: Row, key: str) -> str:
    """A cell ``+1.3 (p 0.002)``: the pooled difference to the baseline and its p-value, naming the
    paired seeds where they are fewer than the row's (``+1.3 (p 0.002; seeds 1, 2)``)."""
    if test.pooled is None:
        return "n/a"
    m = test.pooled.metrics[key]
    paired = list(test.per_seed)
    seeds = (
        f"; seed{'s' * (len(paired) > 1)} {', '.join(map(str, paired))}"
        if len(paired) < len(row.seeds)
        else ""
    )
    return f"{m.delta:+.1f} (p {_p(m.p_value)}{seeds})"


def markdown(
    study: Study,
    runs: list[Run],
    rows: list[Row],
    plots: list[Path],
    notes: list[str],
    tests: list[SettingTests] | None = None,
) -> str:
    """The report: what was run, the table, the paired tests, the plots, every run and what is missing."""
    tests = tests or []
    by_setting = {t.setting: t for t in tests}
    baseline = study.baseline_setting
    buckets = bucket_names(runs)
    cap = training_cap(runs)
    beyond = {b for b in buckets if cap is not None and bucket_low(b) > cap}
    shown = [k for k in FIGURES if any(row.figures[k].values for row in rows)]
    paired = any(t.per_seed for t in tests)
    done = [r for r in runs if r.metrics is not None]
    signature = next((r.metrics.get("bleu_signature") for r in done if r.metrics), None)
    method = next((r.metrics.get("bleu_tokenized_method") for r in done if r.metrics), None)
    lc_method = next((r.metrics.get("bleu_lc_tokenized_method") for r in done if r.metrics), None)
    lines = [
        f"# Position-encoding study: preset `{study.preset}`",
        "",
        f"{study.describe_grid()}; {len(done)} of {len(runs)} runs have figures. {study.provenance()}",
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
    if lc_method:
        lines.append(
            f"BLEU lc tok. is BLEU as the Multi30k literature reports it (`{lc_method}`): Moses "
            "tokenization, lowercased, multi-bleu; set it beside published Multi30k figures, never beside "
            "sacreBLEU."
        )
    if paired:
        lines.append(
            f"vs `{baseline}`: the difference to the baseline setting and the p-value of sacreBLEU's paired "
            "bootstrap resampling, pooled over the seeds both have (named where the row has more; per seed: "
            "below)."
        )
    if beyond:
        lines.append(
            f"Training source sentences have at most {cap} words: buckets marked † hold only longer "
            "sentences (length extrapolation)."
        )
    versus = [f"BLEU vs `{baseline}`", "chrF"] if paired else []
    header = [
        "setting",
        "seeds",
        *(FIGURES[k][0] for k in shown),
        *versus,
        *(b + (" †" if b in beyond else "") for b in buckets),
    ]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    footnotes = False
    for row in rows:
        cells = [f"`{row.setting.name}`", str(len(row.seeds))]
        cells += [row.figures[k].text(FIGURES[k][1], FIGURES[k][2]) for k in shown]
        if paired:
            test = by_setting.get(row.setting)
            cells += ["baseline"] * 2 if test is None else [_versus(test, row, k) for k in ("bleu", "chrf")]
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
    if tests:
        lines += ["", *significance_section(tests, baseline)]
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
        where = study.where(r.eval_path)
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


def significance_section(tests: list[SettingTests], baseline: str) -> list[str]:
    """The per-seed and pooled paired tests as a markdown section."""
    first = next((r for t in tests for r in t.per_seed.values()), None)
    lines = [f"## Paired significance against `{baseline}`", ""]
    if first is None:
        lines.append(
            "No pair of runs has kept test hypotheses (evaluations before tpe-train kept them, or runs not "
            "finished): no paired tests."
        )
        return lines
    lines += [
        f"sacreBLEU's paired bootstrap resampling ({first.samples} resamples, `{first.signatures['bleu']}`) "
        f"of each run's test hypotheses against the `{baseline}` run of the same seed; *pooled*: the seeds' "
        "test sets one after the other, each sentence paired with the same seed's baseline sentence, "
        "resampled together. Scores are the setting's, with the bootstrap 95% confidence half-width; "
        "p < 0.05: a difference this large is unlikely by chance.",
        "",
        "| setting | seeds | BLEU | Δ BLEU | p (BLEU) | chrF | Δ chrF | p (chrF) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for test in tests:
        entries: list[tuple[str, PairedResult]] = [(str(seed), r) for seed, r in test.per_seed.items()]
        if len(test.per_seed) > 1 and test.pooled is not None:
            entries.append((f"pooled ({', '.join(map(str, test.per_seed))})", test.pooled))
        for label, result in entries:
            cells = [f"`{test.setting.name}`", label]
            for key in ("bleu", "chrf"):
                m = result.metrics[key]
                cells += [f"{m.system:.2f} ± {m.system_ci:.2f}", f"{m.delta:+.2f}", _p(m.p_value)]
            lines.append("| " + " | ".join(cells) + " |")
        if test.unpaired:
            lines.append(
                f"| `{test.setting.name}` | {', '.join(map(str, test.unpaired))} | no `{baseline}` run of "
                "this seed: not paired | | | | | |"
            )
        if test.missing:
            lines.append(
                f"| `{test.setting.name}` | {', '.join(map(str, test.missing))} | no kept test hypotheses "
                "on one side | | | | | |"
            )
    return lines


def summary(study: Study, rows: list[Row], tests: list[SettingTests] | None = None) -> dict[str, Any]:
    """The aggregated figures as JSON (``report/summary.json``)."""
    by_setting = {t.setting: t for t in tests or []}
    parts = [
        {"study": p.root.name, "overrides": p.overrides, "settings": p.settings, "seeds": p.seeds}
        for p in getattr(study, "parts", [])
    ]
    return {
        "preset": study.preset,
        "overrides": study.overrides,
        **({"parts": parts} if parts else {}),
        "seeds": study.seeds,
        "average": study.average,
        "baseline": study.baseline_setting,
        "settings": {
            row.setting.name: {
                "seeds": row.seeds,
                **{k: stat.as_dict() for k, stat in row.figures.items()},
                "bleu_by_length": {b: stat.as_dict() for b, stat in row.buckets.items()},
                "too_long": row.too_long,
                "paired": by_setting[row.setting].as_dict() if row.setting in by_setting else None,
            }
            for row in rows
        },
    }


def write_report(study: Study, heatmap_positions: int = 128) -> Path:
    """Gather the study and write ``report/`` (markdown, summary, PNG plots, TensorBoard images)."""
    from tpe_train.study.plots import make_figures, write_figures

    out = study.report_dir
    check_report_dir(out, "tpe-study report", REPORT)  # before any work
    runs = gather(study)
    rows = aggregate(study, runs)
    tests = significance(study, runs)
    figures, notes = make_figures(study, runs, rows, heatmap_positions)
    text_without_plots = markdown(study, runs, rows, [], notes, tests)
    with report_directory(out, "tpe-study report", REPORT) as tmp:
        plots = write_figures(figures, tmp, tmp / "tb", text_without_plots)
        (tmp / "report.md").write_text(markdown(study, runs, rows, plots, notes, tests))
        (tmp / "summary.json").write_text(json.dumps(summary(study, rows, tests), indent=2) + "\n")
    return out / "report.md"


#: The kinds of output (``run.outputs``) of a study's report and of ``tpe-study extrapolate``'s.
REPORT, EXTRAPOLATION_REPORT = "study-report", "extrapolation-report"


def legacy_report(path: Path) -> bool:
    """Whether ``path`` is a report written before output markers existed: report.md, summary.json,
    PNG plots and TensorBoard events, nothing else."""
    files = files_of(path)

    def ours(name: str) -> bool:
        plot = "/" not in name and name.endswith(".png")
        return name in ("report.md", "summary.json") or plot or name.startswith("tb/events.out.tfevents.")

    return "report.md" in files and all(ours(f) for f in files)


def check_report_dir(out: Path, command: str, kind: str) -> None:
    """Refuse a report folder that holds anything but an earlier report (``run.outputs``)."""
    check_output(out, command, kind, legacy=legacy_report, protected=RunDir.what)


def report_directory(out: Path, command: str, kind: str) -> contextlib.AbstractContextManager[Path]:
    """A temporary folder that replaces the report folder ``out`` once filled (``run.outputs``)."""
    return written_directory(out, command, kind, legacy=legacy_report, protected=RunDir.what)


# ---------------------------------------------------------------------------------------------------
# tpe-study extrapolate: the same report machinery for test-time position methods


def _bucket_cell(tests: BucketTests | None, key: str, baseline: bool) -> str:
    """``23.4 ± 1.9`` (the baseline), ``25.0 ± 2.0 (+1.6, p 0.031)`` (a method); ``*``: some sources
    left untranslated (scored empty)."""
    if tests is None:
        return "n/a"
    f = tests.figure(key)
    text = f"{f['score']:.1f} ± {f['ci95']:.1f}"
    if not baseline:
        text += f" ({f['delta']:+.1f}, p {_p(f['p_value'])})"
    return text + ("*" if tests.untranslated else "")


def extrapolation_markdown(outcome: Outcome, plots: list[Path]) -> str:
    """The extrapolation report: what was run, per test set a BLEU, a chrF and an output-length table
    (rows: setting x method; columns: the whole set and each length bucket), the methods, the
    checkpoints, the plots."""
    plan, cap = outcome.plan, outcome.cap
    first = next((t.pooled for r in outcome.rows for t in r.buckets.values()), None)
    signature = f", `{first.signatures['bleu']}`" if first is not None else ""
    groups = outcome.groups()
    rows_text = ", ".join(
        f"`{g}`"
        + (
            f" ({n} checkpoints pooled)"
            if (n := len([c for c in plan.checkpoints if c.group == g])) > 1
            else ""
        )
        for g in groups
    )
    lines = [
        "# Length extrapolation without retraining: test-time position methods",
        "",
        f"{_count(len(plan.checkpoints), 'checkpoint')}, one row per method for each of {rows_text}; "
        f"{_count(len(plan.methods), 'method')} (the baseline included); test sets "
        f"{', '.join(f'`{s}`' for s in outcome.sets())}; {_count(len(plan.cells), 'cell')}: "
        f"{outcome.decoded} decoded now, {outcome.kept} kept from before.",
        "",
        "A cell is the score (sacreBLEU BLEU or chrF) over the bucket's sentences (`all`: the whole set) "
        f"± the half-width of its bootstrap 95% confidence interval ({plan.samples} resamples{signature}); "
        "a method also shows its difference to the unmodified model (`baseline`) on the same sentences and "
        "the p-value of sacreBLEU's paired bootstrap resampling. A setting with several seeds is one row: "
        "its checkpoints' sentences one after the other, each paired with its own checkpoint's baseline "
        "sentence, resampled together (as the study report pools seeds; per checkpoint: `summary.json`).",
        "Buckets are source words"
        + (
            f" (`--buckets {','.join(map(str, plan.buckets))}`)"
            if plan.buckets
            else " (`eval.length_buckets`)"
        )
        + ". A source longer than the encoding can represent (a learned table) is scored as an empty "
        "translation; `*` marks buckets with some. Output length: the translations' length over the "
        "references' (sacreBLEU's 13a tokens, what BLEU's brevity penalty reads; 1.00 = as long).",
    ]
    if cap is not None:
        lines.append(
            f"Training source sentences have at most {cap} words: buckets marked † hold only longer ones."
        )
    for test_set in outcome.sets():
        rows = [r for r in outcome.rows if r.test_set == test_set]
        buckets = outcome.buckets(test_set)
        counts = {
            b: sorted(
                {t.sentences for r in rows if b in r.buckets for t in r.buckets[b].per_checkpoint.values()}
            )
            for b in buckets
        }
        sizes = ", ".join(
            f"{b}: {n[0]}" + (f" to {n[-1]}" if n[-1] != n[0] else "") for b, n in counts.items()
        )
        lines += ["", f"## `{test_set}`", "", f"Sentences per checkpoint: {sizes}.", ""]
        names = [b + (" †" if cap is not None and b != ALL and bucket_low(b) > cap else "") for b in buckets]
        header = ["setting", "method", "checkpoints", *names]
        for key, title in (("bleu", "BLEU"), ("chrf", "chrF")):
            lines += [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            for row in rows:
                cells = [f"`{row.group}`", f"`{row.method.name}`", str(len(row.checkpoints))]
                cells += [_bucket_cell(row.buckets.get(b), key, row.method.name == BASELINE) for b in buckets]
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
        lines += ["### Output length", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for row in rows:
            cells = [f"`{row.group}`", f"`{row.method.name}`", str(len(row.checkpoints))]
            cells += [f"{row.buckets[b].length_ratio:.2f}" if b in row.buckets else "n/a" for b in buckets]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["", "## Methods", ""]
    for method in plan.methods:
        items = {cell.checkpoint.label: " ".join(f"--position {i}" for i in cell.items)
                 for cell in plan.cells if cell.method == method}  # fmt: skip
        shown = sorted(set(items.values()))
        if shown == [""]:
            settings = ""
        elif len(shown) == 1:
            settings = f" (`{shown[0]}`)"
        else:  # settings that depend on the checkpoint (T5's trained max_distance)
            settings = " (" + "; ".join(f"{label}: `{text}`" for label, text in items.items()) + ")"
        lines.append(f"- `{method.name}`: {method.describe()}{settings}")
    for name, labels in plan.skipped.items():
        lines.append(f"- `{name}` does not apply to {', '.join(labels)} (not that encoding there)")
    lines += [
        "",
        "## Checkpoints",
        "",
        "| checkpoint | row | seed | encoding | export |",
        "|---|---|---|---|---|",
    ]
    for c in plan.checkpoints:
        seed = "" if c.seed is None else str(c.seed)
        lines.append(f"| {c.label} | `{c.group}` | {seed} | {c.describe()} | `{c.path}` |")
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{p.stem.replace('_', ' ')}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def extrapolation_summary(outcome: Outcome) -> dict[str, Any]:
    """The extrapolation report's figures as JSON (``summary.json``)."""
    plan = outcome.plan
    sets: dict[str, Any] = {}
    for row in outcome.rows:
        sets.setdefault(row.test_set, {}).setdefault(row.group, {})[row.method.name] = {
            "checkpoints": row.checkpoints,
            "buckets": {b: tests.as_dict() for b, tests in row.buckets.items()},
        }
    return {
        "samples": plan.samples,
        "training_cap": outcome.cap,
        "buckets": plan.buckets,
        "checkpoints": {
            c.label: {
                "path": str(c.path),
                "row": c.group,
                "seed": c.seed,
                "encodings": c.encodings(),
                "weights": c.weights,
            }
            for c in plan.checkpoints
        },
        "methods": {
            m.name: {
                "family": m.family,
                "factor": m.factor,
                "side": m.side,
                "position": {cell.checkpoint.label: cell.items for cell in plan.cells if cell.method == m},
            }
            for m in plan.methods
        },
        "not_applied": plan.skipped,
        "sets": sets,
    }


def write_extrapolation_report(outcome: Outcome) -> Path:
    """``OUT/report/``: report.md, summary.json, one PNG per row group (and TensorBoard images)."""
    from tpe_train.study.plots import extrapolation_figure, write_figures

    out = outcome.plan.out / "report"
    check_report_dir(out, "tpe-study extrapolate", EXTRAPOLATION_REPORT)
    figures = {"extrapolation_" + re.sub(r"[^\w.+-]", "_", g): extrapolation_figure(outcome, g)
               for g in outcome.groups()}  # fmt: skip
    with report_directory(out, "tpe-study extrapolate", EXTRAPOLATION_REPORT) as tmp:
        plots = write_figures(figures, tmp, tmp / "tb", extrapolation_markdown(outcome, []))
        (tmp / "report.md").write_text(extrapolation_markdown(outcome, plots))
        # compact: every bucket of every row holds its paired tests (indented, a 69-cell report was 1.4 MB)
        summary = json.dumps(extrapolation_summary(outcome), separators=(",", ":"))
        (tmp / "summary.json").write_text(summary + "\n")
    return out / "report.md"
