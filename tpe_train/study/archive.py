"""``tpe-study archive``: a study's results without its weights, portable to another machine.

What the report needs of each finished run -- its figures and test hypotheses (not the references: they
are the corpus's test set, which stays where it came from), resolved config, the
run's log (wall time), TensorBoard events and the learned position tables of its export (for the
similarity heat maps, ``positions.safetensors``) -- is copied into another directory, with
``study.json``; checkpoints and exports stay behind (tens of MB a run). ``tpe-study report`` works on
the copy (its paired tests need the references of one run of each pair: a run trained after the
archive was restored, or the study's own report, which ``tpe-study archive`` copies), and
``tpe-study run --out COPY`` skips the runs it holds, so a study too long for one
machine's session goes on elsewhere from the archive (copy it back with ``tpe-study archive ARCHIVE
STUDY_DIR``).

Text files are written with the machine's paths made portable: this Python as ``python``, paths under
the working directory relative to it (``runs/...``, ``../shared/...``: its parent too), the home
directory as ``~``. Into an existing archive the runs are added (a run archived again replaces its
copy) and the manifests merged; archives of different presets or overrides are refused.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import replace
from pathlib import Path

from safetensors.torch import save_file

from tpe_train.ckpt.rundir import RunDir
from tpe_train.evaluation.evaluate import EvalFiles
from tpe_train.run.atomic import temp_name
from tpe_train.study.grid import MANIFEST, RUN_LOG, Study, StudyError
from tpe_train.study.report import REPORT, check_report_dir, report_directory
from tpe_train.study.results import POSITION_TABLES, Run, gather

COMMAND = "tpe-study archive"

TEXT = (".json", ".yaml", ".log")  # rewritten with portable paths; the rest (hypotheses, events) copied


def portable(text: str, cwd: Path | None = None) -> str:
    """``text`` with this machine's paths replaced (see the module docstring)."""
    cwd = (cwd or Path.cwd()).resolve()
    # this environment's interpreter by any of its names (python, python3.11: a console script's
    # shebang and ``python -m`` record different ones)
    text = re.sub(rf"{re.escape(str(Path(sys.executable).parent))}/python[0-9.]*(?![\w.])", "python", text)
    swaps = [(f"{cwd}/", ""), (str(cwd), ".")]
    if cwd.parent != cwd:
        swaps += [(f"{cwd.parent}/", "../")]
    swaps += [(f"{Path.home()}/", "~/")]
    for old, new in swaps:
        text = text.replace(old, new)
    return text


def _copy(src: Path, dst: Path) -> None:
    """Copy one file, replacing ``dst`` whole (a temporary sibling renamed): never half a file."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(dst)
    try:
        if src.suffix in TEXT:
            tmp.write_text(portable(src.read_text()))
        else:
            shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def run_files(runs: list[Run]) -> list[Path]:
    """Every file of these finished runs that the report reads."""
    files: list[Path] = []
    for run in runs:
        evals, rundir = EvalFiles(run.eval_path.parent), RunDir(run.run_dir)
        hypotheses = evals.directory / evals.HYPOTHESES
        kept = (p for p in hypotheses.glob("*") if p.is_file() and p.suffix != ".ref")  # no test set
        files += [evals.figures, *sorted(kept)]
        files += [p for p in (rundir.config, run.run_dir / RUN_LOG) if p.is_file()]
        files += sorted(p for p in rundir.tensorboard.glob("**/*") if p.is_file())
    return files


def archive(source: Path, dest: Path, report: bool = False) -> tuple[Study, int]:
    """Copy ``source``'s finished runs (and with ``report`` its report directory) into ``dest``;
    (the archive's study, runs copied)."""
    study = Study.load(source)
    check_dest(source, dest, report)
    target = replace(
        study,
        root=dest,
        preset=portable(study.preset),
        overrides=[portable(o) for o in study.overrides],
        settings=list(study.settings),
        seeds=list(study.seeds),
        launch=portable(study.launch) if study.launch else None,
    )
    if (dest / MANIFEST).is_file():
        target = Study.load(dest).merge(target)  # refuses another preset, overrides, launch or averaging
    done = [run for run in gather(study) if run.metrics is not None]
    for path in run_files(done):
        _copy(path, dest / path.relative_to(study.root))
    for run in done:  # the learned tables of the export (KBs), for the position-similarity heat maps
        tables = run.learned_tables()
        if tables:
            save_file(tables, str(dest / run.run_dir.relative_to(study.root) / POSITION_TABLES))
    if report:  # replaced whole: an older report's TensorBoard file would show beside the new one
        with report_directory(target.report_dir, COMMAND, REPORT) as tmp:
            for path in sorted(p for p in study.report_dir.glob("**/*") if p.is_file()):
                _copy(path, tmp / path.relative_to(study.report_dir))
    target.save()
    return target, len(done)


def check_dest(source: Path, dest: Path, report: bool) -> None:
    """Refuse, before any work, a ``dest`` that is not new, empty or a study directory (an archive, or
    a study to restore into), that overlaps ``source``, or whose report folder holds anything but a
    report."""
    src, dst = Path(source).resolve(), Path(dest).resolve()
    if dst == src:
        raise StudyError(f"archive {source} into another directory, not into itself")
    if src in dst.parents or dst in src.parents:
        where = "lies inside" if src in dst.parents else "holds"
        raise StudyError(f"{dest} {where} the study {source}; archive it into a folder beside it")
    if dest.exists() and not (dest / MANIFEST).is_file() and any(dest.iterdir()):
        raise StudyError(
            f"{dest} exists and is not a study archive ({MANIFEST} missing); nothing was written or removed. "
            "Pass an empty or new directory"
        )
    if report:
        check_report_dir(Path(dest) / "report", COMMAND, REPORT)
