"""Processes and signals: the node's ``accelerate launch``, and the batch step around ``srun``.

Preemption, end to end (``slurm/*.sbatch`` ask for ``--signal=B:USR1@<seconds>`` and ``--requeue``):

1. Slurm sends SIGUSR1 to the batch step only, where ``supervise_job`` runs (the sbatch script execs it).
2. ``supervise_job`` forwards it to ``srun``, which signals every process of the step on every node:
   the ``tpe-launch run`` task, accelerate's launcher (torchrun's agent) and the trainer ranks.
3. ``run_node`` started accelerate with SIGUSR1 *ignored*; the agent keeps ignoring it (without that,
   the signal's default action kills the agent, pitfall 4 of the cluster notes), the ranks inherit
   that until the trainer installs its own handler. A rank still starting up when the signal came
   gets it from ``run_node`` as soon as it catches SIGUSR1 (read from /proc/<pid>/status).
4. The trainer finishes its step, checkpoints and exits 75; torchrun reports that as a failure, so
   ``run_node`` maps "SIGUSR1 received and the launch failed" back to 75.
5. ``srun`` returns 75; ``supervise_job`` runs ``scontrol requeue $SLURM_JOB_ID`` and the requeued
   job resumes from ``checkpoints/latest``. Any other non-zero code ends the job FAILED.

SIGTERM (scancel, the time limit) reaches every process from Slurm itself: it is never forwarded and
never leads to a requeue.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType

from tpe_train.exits import EXIT_PREEMPTED

FORWARD_AFTER_S = 5.0  # srun needs its tasks running (and their handlers installed) to pass USR1 on


def _say(msg: str) -> None:
    print(f"tpe-launch: {msg}", file=sys.stderr, flush=True)


def descendants(root: int) -> list[int]:
    """Every process below ``root`` (children, grandchildren, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (comm) state"; comm may hold spaces
        children.setdefault(ppid, []).append(int(entry.name))
    out: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``sig`` (the SigCgt mask in /proc)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def exit_code(returncode: int) -> int:
    """A Popen return code as a shell would report it (killed by signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def _ignore_usr1() -> None:  # runs in the child between fork and exec
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


class NodeRun:
    """``tpe-launch run``'s process: starts accelerate, passes preemption on, maps the exit code."""

    def __init__(self, cmd: Sequence[str], env: Mapping[str, str], in_step: bool) -> None:
        self.cmd, self.env, self.in_step = list(cmd), dict(env), in_step
        self.child: subprocess.Popen[bytes] | None = None
        self.preempted = False
        self.told: set[int] = set()  # ranks that have had SIGUSR1 (from Slurm or from us)

    def _on_usr1(self, signum: int, frame: FrameType | None) -> None:
        if not self.preempted and self.child is not None and self.in_step:
            # srun signalled the whole step: whoever catches SIGUSR1 now has had it already
            self.told = {p for p in descendants(self.child.pid) if catches(p, signal.SIGUSR1)}
        self.preempted = True
        self._forward()

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        # inside a step Slurm signals every process itself; locally the agent passes it to the ranks
        if not self.in_step and self.child is not None:
            self.child.send_signal(signal.SIGTERM)

    def _forward(self) -> None:
        """SIGUSR1 to each rank that catches it and has not had it yet."""
        if self.child is None:
            return
        for pid in descendants(self.child.pid):
            if pid not in self.told and catches(pid, signal.SIGUSR1):
                try:
                    os.kill(pid, signal.SIGUSR1)
                except ProcessLookupError:
                    continue
                self.told.add(pid)

    def run(self) -> int:
        signal.signal(signal.SIGUSR1, self._on_usr1)
        signal.signal(signal.SIGTERM, self._on_term)
        self.child = subprocess.Popen(self.cmd, env=self.env, preexec_fn=_ignore_usr1)
        while True:
            try:
                rc = exit_code(self.child.wait(timeout=0.5))
                break
            except subprocess.TimeoutExpired:
                if self.preempted:
                    self._forward()  # ranks that installed their handler since
        if rc != 0 and self.preempted:
            _say(f"preempted (SIGUSR1); the launch ended with {rc}, exiting {EXIT_PREEMPTED} for a requeue")
            return EXIT_PREEMPTED
        return rc


def run_node(cmd: Sequence[str], env: Mapping[str, str]) -> int:
    """Run this node's launch to its end; 75 when it stopped for a preemption."""
    return NodeRun(cmd, env, in_step=bool(env.get("SLURM_STEP_ID"))).run()


class JobSupervisor:
    """The batch step: runs ``srun ...``, forwards SIGUSR1 to it, requeues the job on exit code 75."""

    def __init__(self, cmd: Sequence[str], env: Mapping[str, str]) -> None:
        self.cmd, self.env = list(cmd), dict(env)
        self.child: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.usr1 = False  # asked to checkpoint and stop (Slurm's --signal=B:USR1@N, or by hand)
        self.forwarded = False
        self.term = False  # cancelled or out of time: no requeue

    def _on_usr1(self, signum: int, frame: FrameType | None) -> None:
        self.usr1 = True
        _say("SIGUSR1: asking the trainers to checkpoint and stop")

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        self.term = True

    def run(self) -> int:
        signal.signal(signal.SIGUSR1, self._on_usr1)
        signal.signal(signal.SIGTERM, self._on_term)
        restart = self.env.get("SLURM_RESTART_COUNT")
        if restart and restart != "0":
            _say(f"restart {restart} of job {self.env.get('SLURM_JOB_ID')}: the trainer resumes from latest")
        self.child = subprocess.Popen(self.cmd, env=self.env)
        self.started = time.monotonic()
        while True:
            try:
                rc = exit_code(self.child.wait(timeout=0.3))
                break
            except subprocess.TimeoutExpired:
                # a signal that comes while srun is still starting its tasks would be lost (or kill a
                # task before its handler exists): hold it until the tasks are up
                if self.usr1 and not self.forwarded and time.monotonic() - self.started >= FORWARD_AFTER_S:
                    self.child.send_signal(signal.SIGUSR1)
                    self.forwarded = True
        if rc == EXIT_PREEMPTED and not self.term:
            return self.requeue()
        if rc != 0:
            _say(f"the launch failed with exit code {rc}")
        return rc

    def requeue(self) -> int:
        job = self.env.get("SLURM_JOB_ID")
        if not job:
            _say("the trainer checkpointed and stopped (75); run the same command again to resume")
            return EXIT_PREEMPTED
        proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, env=self.env)
        if proc.returncode != 0:
            _say(
                f"the trainer checkpointed and stopped, but `scontrol requeue {job}` failed "
                f"({proc.stderr.strip()}); submit the same command again to resume from latest"
            )
            return EXIT_PREEMPTED
        _say(f"checkpointed; job {job} requeued, it resumes from latest when it starts again")
        return 0


def supervise_job(cmd: Sequence[str], env: Mapping[str, str]) -> int:
    return JobSupervisor(cmd, env).run()
