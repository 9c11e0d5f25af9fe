"""Running a study's grid: in sequence on this machine, or as Slurm job arrays through ``tpe-launch``.

Locally every run is its own process (``python -m tpe_train.train`` or ``accelerate launch``), its
output appended to ``<run_dir>/study.log``; a run whose figures exist is skipped, so running the same
command again continues a stopped study (and ``train.resume=auto`` continues a stopped run). With
``average`` the last N checkpoints are averaged into ``<run_dir>/averaged-last<N>`` and evaluated there,
as ``tpe-launch submit --script eval`` does on a cluster.

On Slurm, one ``tpe-launch submit --script sweep_positions`` array per seed (and per variant: plain,
``-noenc``, ``-nodec``, and per augmentation), its indices picking the study's encodings, its sweep
root the seed's directory of the study; with ``average``, one ``--script eval`` job per run after its
array element.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from tpe_train.ckpt.rundir import RunDir
from tpe_train.evaluation.evaluate import EvalFiles
from tpe_train.run.exits import EXIT_PREEMPTED
from tpe_train.run.members import MemberError
from tpe_train.study.grid import RUN_LOG, Setting, Study, StudyError

if TYPE_CHECKING:
    from launcher.submit import SubmitArgs

Print = Callable[[str], None]


class StudyPreempted(StudyError):
    """SIGTERM / SIGUSR1 reached the study: its runs saved (or were ended before they could) and no
    other run starts; the same command resumes them from their last checkpoints and trains the rest."""


def _cpu_launch(launch: str) -> bool:
    try:
        return bool((yaml.safe_load(Path(launch).read_text()) or {}).get("use_cpu"))
    except (OSError, yaml.YAMLError):
        return False


def _tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return "\n".join("    " + line for line in text[-lines:])


def run_local(
    study: Study, dry_run: bool = False, echo: bool = False, say: Print = print, jobs: int = 1
) -> list[str]:
    """Train (and evaluate) every run of the grid that has no figures yet: ``jobs`` at a time, each
    with an equal share of this machine's cores (``train.threads``, unless the overrides set it).
    Returns the failed runs (``setting seed S``); stops early (``StudyError``) on a preemption."""
    if study.launch and not Path(study.launch).is_file():
        raise StudyError(f"--launch {study.launch}: no such launch file (configs/accelerate/*.yaml)")
    if jobs < 1:
        raise StudyError(f"--jobs must be at least 1, got {jobs}")
    grid = study.grid()
    for setting, seed in grid:  # every config is checked before the first run starts
        study.config(setting, seed)
    env = dict(os.environ)
    if study.launch and _cpu_launch(study.launch):
        env.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed on CPU processes uses gloo
    extra = _thread_share(study, jobs)
    lock = threading.Lock()

    def tell(line: str) -> None:  # whole lines, also from parallel runs
        with lock:
            say(line)

    pending: list[tuple[str, Setting, int]] = []
    for number, (setting, seed) in enumerate(grid, 1):
        label = f"[{number}/{len(grid)}] {setting.name} seed {seed}"
        if study.eval_path(setting, seed).is_file():
            say(f"{label}: done already ({study.eval_path(setting, seed)})")
        elif dry_run:
            say(f"{label}: {shlex.join(study.train_command(setting, seed, extra))}")
            if study.average:
                say(f"{label}: then average the last {study.average} checkpoints and evaluate them")
        else:
            pending.append((label, setting, seed))
    if dry_run or not pending:
        return []
    runs = _Processes()
    failed: list[str] = []
    preempted: list[str] = []

    def one(label: str, setting: Setting, seed: int) -> None:
        if preempted or runs.stopped:
            return
        outcome = _train_and_evaluate(study, setting, seed, extra, env, runs, echo and jobs == 1, label, tell)
        if outcome == "preempted":
            preempted.append(label)
        elif outcome == "stopped":
            preempted.append(f"{label} (ended before it saved)")
        elif outcome != "ok":
            failed.append(f"{setting.name} seed {seed}")

    with runs.forwarding_signals(), ThreadPoolExecutor(max_workers=jobs) as pool:
        try:
            for future in [pool.submit(one, *item) for item in pending]:
                future.result()
        except BaseException:  # Ctrl-C: no new runs; the running ones save and stop
            runs.terminate()
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    if preempted or runs.stopped:
        stopped = ", ".join(preempted) or "no run was training"
        raise StudyPreempted(
            f"the study was stopped by a signal ({stopped}); run the same tpe-study command again to resume "
            "the stopped runs from their last checkpoints (train.resume=auto, the default) and train the rest"
        )
    return failed


def _thread_share(study: Study, jobs: int) -> list[str]:
    """``train.threads=<cores // jobs>`` for parallel local runs, unless the study's overrides set it."""
    if jobs == 1 or any(o.partition("=")[0].strip() == "train.threads" for o in study.overrides):
        return []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return [f"train.threads={max(1, cores // jobs)}"]


def _train_and_evaluate(
    study: Study,
    setting: Setting,
    seed: int,
    extra: list[str],
    env: dict[str, str],
    runs: _Processes,
    echo: bool,
    label: str,
    say: Print,
) -> str:
    """One run of the grid: train it (unless its export was evaluated already), average and evaluate
    with ``average``; ``ok``, ``failed``, ``preempted`` (saved) or ``stopped`` (ended by the
    study's signal before it saved)."""
    run_dir = study.run_dir(setting, seed)
    trained = EvalFiles(run_dir).figures  # written by training's final evaluation
    if not trained.is_file():
        run_dir.mkdir(parents=True, exist_ok=True)
        log = run_dir / RUN_LOG
        say(f"{label}: training in {run_dir} (log: {log})")
        start = time.perf_counter()
        code = runs.run_logged(study.train_command(setting, seed, extra), env, log, echo)
        if code == EXIT_PREEMPTED:
            return "preempted"
        if code != 0 and runs.stopped:
            say(f"{label}: stopped by the signal before it saved (exit {code})")
            return "stopped"
        if code != 0 or not trained.is_file():
            say(f"{label}: FAILED (exit {code}); the end of {log}:\n{_tail(log)}")
            return "failed"
        say(f"{label}: trained in {time.perf_counter() - start:.0f} s")
    if study.average:
        try:
            average_and_evaluate(study, setting, seed, lambda line: say(f"{label}: {line}"))
        except Exception as err:  # reported per run: the other runs of the study go on
            say(f"{label}: averaging or evaluating FAILED: {err}")
            return "failed"
    try:
        figures = study.eval_files(setting, seed).read_figures()
    except MemberError as err:
        figures, problem = None, str(err)
    else:
        problem = f"{study.eval_path(setting, seed)} is missing"
    if figures is None:
        say(f"{label}: FAILED: {problem}")
        return "failed"
    say(f"{label}: BLEU {figures['bleu']:.2f} ({study.eval_path(setting, seed)})")
    return "ok"


class _Processes:
    """The study's live training processes; SIGTERM / SIGUSR1 to the study are passed on to all of them
    (preemption of the study preempts its runs: each saves a checkpoint and exits 75)."""

    def __init__(self) -> None:
        self.live: set[subprocess.Popen[str]] = set()
        self.lock = threading.RLock()  # the signal handler takes it too, in the main thread
        self.stopped = False  # after ``terminate``, a run that starts late is stopped at once

    @contextlib.contextmanager
    def forwarding_signals(self) -> Iterator[None]:
        def forward(signum: int, frame: object) -> None:
            with self.lock:  # no run starts after it, whatever the running ones do with the signal
                self.stopped = True
                for proc in self.live:
                    proc.send_signal(signum)

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1)}
        try:
            yield
        finally:  # once stopping, the study ignores further signals as its trainers do: it exits 75 next
            for sig, handler in previous.items():
                signal.signal(sig, signal.SIG_IGN if self.stopped else handler)

    def terminate(self) -> None:
        """SIGTERM to every running run: the trainer saves and exits; the next tpe-study run resumes it."""
        with self.lock:
            self.stopped = True
            for proc in self.live:
                proc.terminate()

    def run_logged(self, cmd: list[str], env: dict[str, str], log: Path, echo: bool) -> int:
        """Run ``cmd`` with its output appended to ``log`` (and shown on the terminal with ``echo``),
        between a line saying when it started and one saying how it ended. Line-buffered: ``tail -f``
        shows each line of a run as it is printed, not 8 KiB at a time."""
        with open(log, "a", buffering=1) as out:
            out.write(f"\n# started {_stamp()}\n$ {shlex.join(cmd)}\n")
            out.flush()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
            assert proc.stdout is not None
            with self.lock:
                self.live.add(proc)
                if self.stopped:
                    proc.terminate()
            try:
                for line in proc.stdout:
                    out.write(line)
                    if echo:
                        sys.stdout.write(line)
                code = proc.wait()
                out.write(f"# exit {code} at {_stamp()}\n")
                return code
            finally:
                with self.lock:
                    self.live.discard(proc)
                if proc.poll() is None:  # interrupted: let the trainer save and exit
                    proc.terminate()
                    proc.wait()


def _stamp() -> str:
    """Local time, and Unix time for scripts: ``2026-11-30 18:30:01 (unix 1796063401.123)``."""
    now = time.time()
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now))} (unix {now:.3f})"


def average_and_evaluate(study: Study, setting: Setting, seed: int, say: Print = print) -> Path:
    """The mean of the run's last ``study.average`` complete checkpoints, exported to
    ``RUN/averaged-lastN`` (what ``tpe-ckpt average`` writes) and evaluated there: its figures and the
    test hypotheses scored (what ``tpe-eval --out`` keeps). Returns the figures' path."""
    import torch

    from tpe_train.ckpt.export import export_mean, load_export
    from tpe_train.ckpt.store import entries
    from tpe_train.evaluation.decoding import device_from_arg
    from tpe_train.evaluation.evaluate import config_sets, evaluate

    run_dir = study.run_dir(setting, seed)
    chosen = [e.path for e in entries(RunDir(run_dir).checkpoints) if e.complete][-study.average :]
    if not chosen:
        raise StudyError(f"{run_dir} has no complete checkpoint to average (train.save_every)")
    if len(chosen) < study.average:
        say(f"only {len(chosen)} complete checkpoints; averaging those")
    files = study.eval_files(setting, seed)
    export_mean(chosen, files.directory)
    say(f"averaged {', '.join(p.name for p in chosen)} -> {files.directory}")
    model, cfg, tok = load_export(files.directory)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    model.to(device_from_arg("auto"))
    result = evaluate(model, tok, config_sets(cfg.data), cfg.eval, lang=cfg.data.tgt_lang)
    return files.write(result)


def _submit_args(slurm_args: list[str]) -> SubmitArgs:
    """``--slurm-args`` read as ``tpe-launch submit`` reads its options: the resources of every job."""
    try:
        from launcher.cli import submit_args, submit_parser
        from launcher.plan import LaunchError
    except ImportError as err:
        raise StudyError(
            f"--slurm needs the launcher package (tpe-launch, in launcher/ of the repository), which does "
            f"not import here ({err}); install the repository (pip install -e .) or run the study locally"
        ) from None
    try:
        ns = submit_parser().parse_intermixed_args(slurm_args)
    except LaunchError as err:
        raise StudyError(f"--slurm-args: {err}") from None
    if ns.overrides:
        raise StudyError(
            f"--slurm-args holds config overrides ({' '.join(ns.overrides)}); give them to tpe-study run "
            "itself, after its options"
        )
    try:
        return submit_args(ns)  # over the user's site file, as tpe-launch submit reads it
    except LaunchError as err:
        raise StudyError(f"--slurm-args: {err}") from None


def _sweep_index(kind: str) -> int:
    from launcher.plan import position_sweep

    sweep = position_sweep()  # the built-ins, then the installed packages' encodings
    if kind not in sweep:
        raise StudyError(
            f"tpe-launch's position sweep has no array index for {kind!r} (it sweeps "
            f"{' '.join(sweep)}); run this setting locally"
        )
    return sweep.index(kind)


def _submit(args: SubmitArgs, dry_run: bool) -> tuple[str, str]:
    """Render (and unless ``dry_run`` sbatch) one job: (what to show, its job id)."""
    from launcher.plan import LaunchError
    from launcher.submit import build, dry_run_text, report, submit

    try:
        sub = build(args)
        if dry_run:
            return dry_run_text(sub), "<array job>" if args.array else "<job>"
        job = submit(sub)
    except LaunchError as err:
        raise StudyError(f"tpe-launch submit --script {args.script} refused: {err}") from None
    return report(sub, job), job


def submit_slurm(study: Study, slurm_args: list[str], dry_run: bool = False, say: Print = print) -> None:
    """One ``sweep_positions`` job array per seed and variant, its indices the study's encodings (plus
    one ``eval`` job per run after its array element with ``average``), through tpe-launch's library;
    submitted jobs are recorded in ``study.json``."""
    base = _submit_args(slurm_args)
    if study.launch:
        base = dataclasses.replace(base, layout=study.launch)
    groups: dict[tuple[int, str], list[Setting]] = {}  # one sweep root: a seed, variant and augmentation
    for setting, seed in study.grid():
        if not study.eval_path(setting, seed).is_file():
            groups.setdefault((seed, setting.suffix), []).append(setting)
    if not groups:
        say("every run of the study has its figures already; nothing to submit")
        return
    # evaluation runs on one node in one process, whatever the training layout
    eval_base = dataclasses.replace(base, nodes=1, layout=None, procs_per_node=None, signal_before=300)
    for (seed, suffix), settings in groups.items():
        indices = [_sweep_index(s.kind) for s in settings]
        overrides = [o for o in study.run_overrides(settings[0], seed) if not o.startswith(
            ("model.position.kind=", "train.run_dir="))]  # fmt: skip
        sweep = dataclasses.replace(
            base,
            script="sweep_positions",
            preset=study.preset,
            array=",".join(map(str, indices)),
            sweep_root=str(study.sweep_root(settings[0], seed).resolve()),
            job_name=f"tpe-study-s{seed}{suffix}",
            overrides=overrides,
        )
        shown, job = _submit(sweep, dry_run)
        say(shown.rstrip())
        if not dry_run:
            study.slurm_jobs.append(
                {"seed": seed, "variant": suffix.lstrip("-"), "job": job, "array": indices}
            )
        for setting, index in zip(settings, indices, strict=True):
            if not study.average:
                continue
            evaluation = dataclasses.replace(
                eval_base,
                script="eval",
                preset=study.preset,
                last=study.average,
                dependency=f"afterok:{job}_{index}",
                overrides=study.run_overrides(setting, seed),
            )
            shown, eval_job = _submit(evaluation, dry_run)
            say(shown.rstrip())
            if not dry_run:
                study.slurm_jobs.append({"seed": seed, "setting": setting.name, "eval_job": eval_job})
    if not dry_run:
        study.save()
        say(f"when the jobs are done: tpe-study report {study.root}")
