"""``tpe-study``: run a grid of position-encoding settings x seeds from one preset, then report.

    tpe-study run --preset P [--encodings a,b,...] [--seeds 1,2,3] [--out DIR] [overrides ...]
    tpe-study run ... --jobs 2                                       # 2 runs at a time, cores shared
    tpe-study run ... --launch configs/accelerate/cpu_ddp.yaml      # each run under accelerate launch
    tpe-study run ... --slurm --slurm-args "--gpus-per-node 8 --time 24:00:00"   # Slurm job arrays
    tpe-study report DIR [--baseline rope]                           # gather again, no training
    tpe-study archive DIR DEST                  # results without weights, machine paths made relative
    tpe-study extrapolate DIR [--methods rope-yarn,alibi-slope] [--factors 2,4] [--concat 2,3]
    tpe-study extrapolate --checkpoint A --checkpoint B ...     # test-time position methods, no training

Settings: <kind> (any registered encoding; the default grid is the seven older ones), <kind>-noenc (no
position information in the encoder only), <kind>-nodec (none in the decoder only), <kind>+<augment>
(trained with a position augmentation, e.g. learned+randomized). Bad input stops with one paragraph on
stderr and exit code 2 before any work; a failed run makes the exit code 1; a preempted
run stops the study with 75 (run the same command again to resume).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex
import sys
from pathlib import Path
from typing import NoReturn

from tpe_train.run import logs
from tpe_train.run.exits import EXIT_PREEMPTED
from tpe_train.run.lock import RunDirBusy, RunLock
from tpe_train.run.members import MemberError
from tpe_train.run.outputs import OutputRefused
from tpe_train.study.terms import ENCODINGS, StudyError

log = logging.getLogger(__name__)


class Parser(argparse.ArgumentParser):
    """Argument errors are one line (see ``main``), not a usage block."""

    def error(self, message: str) -> NoReturn:
        raise StudyError(f"{message} (see {self.prog} --help)")


def run_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="tpe-study run",
        description="Train every setting x seed of the grid from one preset (skipping runs that have "
        "their figures), then write the report. Each run is python -m tpe_train.train --preset P "
        "[overrides] model.position.kind=K train.seed=S train.run_dir=DIR/runs/s<S>/<K>.",
    )
    p.add_argument("--preset", default="demo", help="preset name in configs/presets or a YAML path")
    p.add_argument(
        "--encodings",
        default=",".join(ENCODINGS),
        help="comma-separated settings: <kind>, <kind>-noenc, <kind>-nodec, <kind>+<augment> such as "
        "sinusoidal+shape (default: the seven older kinds)",
    )
    p.add_argument(
        "--seeds",
        default="1,2,3",
        help="seeds, e.g. 1,2,3 or 1-3 (default 1,2,3); on an existing --out, the runs of these --encodings "
        "x --seeds are added to the study's (seed 2 of two settings: two more runs)",
    )
    p.add_argument("--out", default=None, help="study directory (default runs/study-<preset>)")
    p.add_argument(
        "--launch", default=None, help="accelerate launch file for every run (configs/accelerate/)"
    )
    p.add_argument(
        "--average",
        type=int,
        default=0,
        help="average the last N checkpoints of each run and report that model (papers: 5 base, 20 big)",
    )
    p.add_argument(
        "--slurm", action="store_true", help="submit job arrays with tpe-launch instead of running"
    )
    p.add_argument(
        "--slurm-args",
        default="",
        help='tpe-launch submit options, one string: "--nodes 1 --gpus-per-node 8 --time 24:00:00 ..."',
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="local runs at a time, each with cores/jobs threads (default 1; two 1-thread runs on 2 cores "
        "train about 1.3x more tokens/s than one 2-thread run)",
    )
    p.add_argument(
        "--baseline",
        default=None,
        help="the setting the report's paired significance tests compare every other against (default: "
        "sinusoidal when the study has it, else the first setting)",
    )
    p.add_argument("--dry-run", action="store_true", help="print what would run or be submitted; do nothing")
    p.add_argument("--verbose", action="store_true", help="show every run's output (always in its study.log)")
    p.add_argument("--no-report", action="store_true", help="do not write the report after the runs")
    p.add_argument("--heatmap-positions", type=int, default=128, help="positions in the similarity heat maps")
    p.add_argument(
        "overrides", nargs="*", help="dotted config overrides for every run, e.g. train.max_steps=600"
    )
    return p


def report_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="tpe-study report",
        description="Gather a study directory again: markdown table, summary.json, PNG plots and TensorBoard "
        "images under DIR/report (no training).",
    )
    p.add_argument("study_dir")
    p.add_argument("--heatmap-positions", type=int, default=128, help="positions in the similarity heat maps")
    p.add_argument("--baseline", default=None, help="the setting paired tests compare against (this report)")
    p.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="DIR",
        help="another study directory or archive of the same preset whose runs join this report (repeatable; "
        "its overrides may differ and are listed); a setting and seed held by two directories is taken from "
        "the one named first (STUDY_DIR, then the --include order), the other's BLEU noted",
    )
    p.add_argument("--out", default=None, help="the report folder (default STUDY_DIR/report)")
    return p


def archive_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="tpe-study archive",
        description="Copy the finished runs' figures, test hypotheses, configs, logs and TensorBoard events "
        "(no weights, no test references) with study.json into DEST, this machine's paths made relative, "
        "with the study's report. Adds to an existing archive; tpe-study run --out DEST skips the runs it "
        "holds.",
    )
    p.add_argument("study_dir")
    p.add_argument("dest")
    p.add_argument("--no-report", action="store_true", help="do not write and copy the report")
    return p


def cmd_archive(argv: list[str]) -> int:
    args = archive_parser().parse_args(argv)
    # torch and the rest: after the arguments parse
    from tpe_train.study.archive import archive, check_dest
    from tpe_train.study.grid import Study
    from tpe_train.study.report import write_report
    from tpe_train.study.results import kept_references

    source = Study.load(Path(args.study_dir))
    check_dest(source.root, Path(args.dest), not args.no_report)  # before the report is written
    if not args.no_report:
        if kept_references(source) or not (source.report_dir / "report.md").is_file():
            print(f"report: {write_report(source)}")  # from the study, whose runs kept the references
        else:  # an archive (no references): a new report would lose the paired tests its own has
            kept = source.report_dir / "report.md"
            print(f"report: {kept} (an archive without references keeps its report)")
    study, done = archive(source.root, Path(args.dest), report=not args.no_report)
    print(f"archived {done} finished runs of {args.study_dir} into {study.root}")
    return 0


def cmd_run(argv: list[str]) -> int:
    args = run_parser().parse_intermixed_args(argv)
    # torch and the rest: after the arguments parse
    from tpe_train.study.grid import Study, parse_seeds, parse_setting
    from tpe_train.study.runner import run_local, submit_slurm

    settings = [s.strip() for s in args.encodings.split(",") if s.strip()]
    for name in settings:
        parse_setting(name)
    if len(set(settings)) != len(settings):
        raise StudyError(f"--encodings {args.encodings!r} names a setting twice")
    preset = str(Path(args.preset).resolve()) if Path(args.preset).is_file() else args.preset
    out = Path(args.out or f"runs/study-{Path(args.preset).stem}")
    launch = str(Path(args.launch).resolve()) if args.launch and Path(args.launch).is_file() else args.launch
    study = Study(out, preset, list(args.overrides), settings, parse_seeds(args.seeds), launch, args.average,
                  args.baseline)  # fmt: skip
    if (out / "study.json").is_file():
        study = Study.load(out).merge(study)
    study.grid()  # settings are valid
    if args.slurm:
        if args.dry_run:
            submit_slurm(study, shlex.split(args.slurm_args), dry_run=True)
            return 0
        with _own(out):  # while it submits: two submissions of one study would train every run twice
            study.save()
            submit_slurm(study, shlex.split(args.slurm_args))
        return 0
    if args.slurm_args:
        raise StudyError("--slurm-args applies to --slurm; drop it, or add --slurm")
    if args.jobs > 1 and args.launch:
        raise StudyError(
            "--jobs runs plain one-process runs side by side; with --launch each run already uses the "
            "machine's processes: drop --jobs or --launch"
        )
    if args.dry_run:
        run_local(study, dry_run=True, jobs=args.jobs)
        return 0
    if not args.no_report:  # a report folder it may not replace: said now, not after the runs
        from tpe_train.study.report import REPORT, check_report_dir

        check_report_dir(study.report_dir, "tpe-study report", REPORT)
    with _own(out):
        study.save()
        failed = run_local(study, echo=args.verbose, jobs=args.jobs)
        if not args.no_report:
            from tpe_train.study.report import write_report

            print(f"report: {write_report(study, args.heatmap_positions)}")
            print(f"images: tensorboard --logdir {study.report_dir / 'tb'}; runs: tensorboard --logdir {out}")
    if failed:
        log.error("%d runs failed: %s", len(failed), ", ".join(failed))
        return 1
    return 0


def _own(out: Path) -> RunLock:
    """The study directory's lock: a second ``tpe-study run`` on it stops before any work."""
    return RunLock(out, fix="pass another --out", prog="tpe-study")


def cmd_report(argv: list[str]) -> int:
    args = report_parser().parse_args(argv)
    # torch and the rest: after the arguments parse
    from tpe_train.study.grid import Study
    from tpe_train.study.report import write_report

    study = Study.load(Path(args.study_dir))
    if args.include or args.out:
        from tpe_train.study.combine import combine

        others = [Study.load(Path(d)) for d in args.include]
        study = combine(study, others, Path(args.out) if args.out else None)
    if args.baseline is not None:
        study = dataclasses.replace(study, baseline=args.baseline)  # validated as a setting of the study
    print(f"report: {write_report(study, args.heatmap_positions)}")
    return 0


def extrapolate_parser() -> argparse.ArgumentParser:
    from tpe_train.study.position_methods import FAMILIES

    p = Parser(
        prog="tpe-study extrapolate",
        description="Score trained checkpoints with test-time position methods (no retraining) on a test set "
        "and its N-sentence concatenations: BLEU and chrF per source-length bucket with bootstrap 95% "
        "confidence intervals and paired tests against the unmodified model; a report with tables and "
        "plots in OUT/report. Decoded cells are kept in OUT/cells: the same command again decodes only "
        "what is new.",
    )
    p.add_argument("study_dir", nargs="?", default=None, help="a study directory: every run's export")
    p.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        help="an export (repeatable), instead of a study; the model a run's report scored is the one its "
        "eval.json names under selected (RUN/averaged-lastN under eval.select=average_last), not "
        "RUN/checkpoint (the last step)",
    )
    p.add_argument(
        "--label",
        action="append",
        default=[],
        help="the name of the --checkpoint in the same place, in the report and its cells (repeatable: "
        "one per --checkpoint; default: from each path)",
    )
    p.add_argument("--out", default=None, help="where cells and report go (default STUDY/extrapolate, or "
                   "runs/extrapolate for --checkpoint)")  # fmt: skip
    p.add_argument(
        "--methods",
        default=None,
        help=f"comma-separated method families (default: every one that applies): {', '.join(FAMILIES)}",
    )
    p.add_argument("--factors", default="2,4", help="factors s > 1 of every family (default 2,4)")
    p.add_argument(
        "--sides",
        default="both",
        help="where the families act: comma-separated encoder, decoder, cross, both (default both)",
    )
    p.add_argument(
        "--custom",
        action="append",
        default=[],
        metavar="LABEL=KEY=VALUE[,KEY=VALUE]",
        help="a method of any --position settings, e.g. yarn3e=rope.scaling=yarn,rope.factor=3,side=encoder",
    )
    p.add_argument(
        "--yarn-original",
        type=int,
        default=None,
        help="YaRN's trained context in tokens (rope.original, xpos.original; default data.max_len + 1, as "
        "tpe-eval): give "
        "the longest training sequence when training used shorter sentences than data.max_len",
    )
    p.add_argument(
        "--split",
        default=None,
        help="comma-separated splits of the models' corpus (default: the config's test split)",
    )
    p.add_argument("--src", action="append", default=[], help="a source file (with --ref; repeatable)")
    p.add_argument("--ref", action="append", default=[], help="its reference file, line by line")
    p.add_argument(
        "--concat", default="2,3", help="also every set as N-sentence segments (default 2,3; 0: none)"
    )
    p.add_argument(
        "--limit", type=int, default=None, help="only the first N pairs of each set (named SET[:N])"
    )
    p.add_argument("--buckets", default=None, help="length bucket edges in source words (default: "
                   "eval.length_buckets of each checkpoint), e.g. 8,16,24,32,48")  # fmt: skip
    p.add_argument("--beam", type=int, default=None, help="override eval.beam (1: greedy)")
    p.add_argument("--samples", type=int, default=1000, help="bootstrap resamples (default 1000)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--dry-run", action="store_true", help="check everything and list the cells; decode nothing"
    )
    return p


def cmd_extrapolate(argv: list[str]) -> int:
    args = extrapolate_parser().parse_args(argv)
    # torch and the rest: after the arguments parse
    from tpe_train.evaluation.decoding import device_from_arg
    from tpe_train.study import extrapolate as ex
    from tpe_train.study.grid import Study
    from tpe_train.study.position_methods import methods_of, parse_list
    from tpe_train.study.report import EXTRAPOLATION_REPORT, check_report_dir, write_extrapolation_report
    from tpe_train.study.results import config_cap

    if (args.study_dir is None) == (not args.checkpoint):
        raise StudyError("give a study directory or --checkpoint PATH (repeatable), one of the two")
    if args.label and not args.checkpoint:
        raise StudyError("--label names --checkpoint exports; a study's runs keep their study labels")
    if len(args.src) != len(args.ref):
        raise StudyError(
            f"{len(args.src)} --src but {len(args.ref)} --ref; give each source file its reference"
        )
    if args.limit is not None and args.limit < 1:
        raise StudyError("--limit must be at least 1 (sentences of each set)")
    families = None if args.methods is None else parse_list(args.methods, "--methods")
    factors, sides = parse_list(args.factors, "--factors", float), parse_list(args.sides, "--sides")
    methods = methods_of(families, factors, sides, args.custom, args.yarn_original)
    concat = [n for n in parse_list(args.concat, "--concat", int) if n != 0]
    buckets = None if args.buckets is None else parse_list(args.buckets, "--buckets", int)
    if args.study_dir is not None:
        study = Study.load(Path(args.study_dir))
        checkpoints: list[tuple[Path, str, str, int | None]] = list(ex.study_exports(study))
        out = Path(args.out) if args.out else study.root / "extrapolate"
    else:
        checkpoints = ex.checkpoint_rows([Path(c) for c in args.checkpoint], args.label)
        out = Path(args.out or "runs/extrapolate")
    try:
        device = device_from_arg(args.device)
    except ValueError as err:
        raise StudyError(str(err)) from None
    splits = tuple(parse_list(args.split or "", "--split"))
    sets = ex.SetSpec(splits, tuple(zip(args.src, args.ref, strict=True)), tuple(concat), args.limit)
    named = args.methods is not None or bool(args.custom)
    plan = ex.make_plan(out, checkpoints, methods, sets, args.samples, args.beam, buckets, named, device.type)
    if args.dry_run:
        ex.run_plan(plan, device, dry_run=True)
        return 0
    check_report_dir(out / "report", "tpe-study extrapolate", EXTRAPOLATION_REPORT)  # before decoding
    with RunLock(out, fix="pass another --out", prog="tpe-study extrapolate"):
        decoded, kept = ex.run_plan(plan, device)
        rows = ex.score(plan)
        caps = {config_cap(c.cfg) for c in plan.checkpoints}
        outcome = ex.Outcome(plan, rows, caps.pop() if len(caps) == 1 else None, decoded, kept)
        print(f"report: {write_extrapolation_report(outcome)} ({decoded} cells decoded, {kept} kept)")
    return 0


COMMANDS = {"run": cmd_run, "report": cmd_report, "archive": cmd_archive, "extrapolate": cmd_extrapolate}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``tpe-study``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if command is None:
        logs.configure("tpe-study")
        log.error("unknown command %r; use one of %s", argv[0], ", ".join(COMMANDS))
        return 2
    logs.configure(f"tpe-study {argv[0]}")
    try:
        return command(argv[1:])
    except _loaded("tpe_train.study.runner", "StudyPreempted") as err:
        log.warning("%s", err)
        return EXIT_PREEMPTED
    except KeyboardInterrupt:
        log.warning("interrupted; the same command resumes the study")
        return 130
    except _bad_input() as err:
        log.error("%s", err)  # MemberError: a damaged eval.json
        return 2


def _bad_input() -> tuple[type[BaseException], ...]:
    """What stops a command with exit status 2 and one line: bad input, a busy or refused output."""
    return (StudyError, RunDirBusy, OutputRefused, MemberError, *_loaded("tpe_train.config", "ConfigError"))


def _loaded(module: str, name: str) -> tuple[type[BaseException], ...]:
    """The error class ``module.name`` where that module is loaded, else none: a module not imported
    raised nothing, and importing the config (torch) only to name its error would cost ``--help`` 2 s."""
    found = sys.modules.get(module)
    return (getattr(found, name),) if found is not None else ()


if __name__ == "__main__":
    sys.exit(main())
