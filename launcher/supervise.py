"""Processes and signals: the node's ``accelerate launch``, and the batch step around ``srun``.

Preemption, end to end (``slurm/*.sbatch`` ask for ``--signal=B:USR1@<seconds>`` and ``--requeue``):

1. Slurm sends SIGUSR1 to the batch step only, where ``supervise_job`` runs (the sbatch script execs it).
2. ``supervise_job`` forwards it to ``srun``, which signals every process of the step on every node:
   the ``tpe-launch run`` task, accelerate's launcher (torchrun's agent) and the trainer ranks.
3. ``run_node`` started accelerate with SIGUSR1 *ignored*; the agent keeps ignoring it (without that,
   the signal's default action kills the agent, pitfall 4 of the cluster notes), the ranks inherit
   that until the trainer installs its own handler. A rank still starting up when the signal came
   gets it from ``run_node`` as soon as it catches SIGUSR1 (read from /proc/<pid>/status).
4. Every rank finishes its step, takes part in the checkpoint and exits 75, leaving a record in the
   node's exit-record directory (``TPE_EXIT_RECORD_DIR``): torchrun reports any non-zero exit as one
   failure, so the records are how ``run_node`` knows that *each* of its ranks exited 75.
5. A node whose ranks all exited 75 is *preempted*: its ``tpe-launch run`` writes
   ``node-<SLURM_NODEID>.json`` into the job's status directory (``TPE_JOB_STATUS_DIR``, on the shared
   file system, made by ``supervise_job``) and ends its srun task with **0**, so that srun, which runs
   with ``--kill-on-bad-exit=1``, never takes a preempted node for a failed one and never kills the
   nodes still finishing their part. Any other non-zero end is a *failure*: that task exits non-zero,
   srun stops every other node at once (nothing waits in a collective for a dead peer) and fails.
6. ``supervise_job`` requeues the job (``scontrol requeue $SLURM_JOB_ID``) when srun succeeded and a
   node record says preempted; the requeued job resumes from ``checkpoints/latest``. srun's own exit
   code cannot say this: it is the highest code of the tasks (75 hides a real failure's 1 or 2), or
   143 once ``--kill-on-bad-exit`` has terminated a task. A failure ends the job FAILED.

SIGTERM (scancel, the time limit) reaches every process from Slurm itself: it is never forwarded and
never leads to a requeue (the trainers still checkpoint when they can).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType

from tpe_train.run.exits import EXIT_PREEMPTED, EXIT_RECORDS

log = logging.getLogger(__name__)

JOB_STATUS = "TPE_JOB_STATUS_DIR"  # where each node's tpe-launch run records how its launch ended
STATUS_DIR = ".tpe-launch"  # under --status-dir: one directory per job attempt, removed after it

FORWARD_AFTER_S = 5.0  # srun needs its tasks running (and their handlers installed) to pass USR1 on


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
    """``tpe-launch run``'s process: starts accelerate, passes preemption on, reports how it ended."""

    def __init__(self, cmd: Sequence[str], env: Mapping[str, str], in_step: bool, ranks: int = 1) -> None:
        self.cmd, self.env, self.in_step, self.ranks = list(cmd), dict(env), in_step, ranks
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
        records = tempfile.mkdtemp(prefix="tpe-exit-")  # on this node: only its own ranks write here
        try:
            self.child = subprocess.Popen(
                self.cmd, env={**self.env, EXIT_RECORDS: records}, preexec_fn=_ignore_usr1
            )
            while True:
                try:
                    rc = exit_code(self.child.wait(timeout=0.5))
                    break
                except subprocess.TimeoutExpired:
                    if self.preempted:
                        self._forward()  # ranks that installed their handler since
            stopped = sum(_read_code(p) == EXIT_PREEMPTED for p in Path(records).glob("rank-*.exit"))
        finally:
            shutil.rmtree(records, ignore_errors=True)
        outcome = "done" if rc == 0 else "preempted" if stopped == self.ranks else "failed"
        host = self.env.get("SLURMD_NODENAME") or socket.gethostname()
        here = f"node {self.env.get('SLURM_NODEID', 0)} ({host})"
        if outcome == "failed":
            log.error(f"{here}: the launch failed with exit code {rc} ({stopped} of {self.ranks} ranks here "
                      f"checkpointed and exited {EXIT_PREEMPTED})")  # fmt: skip
        elif outcome == "preempted":
            log.info(
                f"{here}: every rank here ({self.ranks}) checkpointed and exited {EXIT_PREEMPTED}: preempted"
            )
        if outcome == "failed" and rc == EXIT_PREEMPTED:
            rc = 1  # 75 means "every rank checkpointed", which the records do not show
        status = self.env.get(JOB_STATUS)
        if not status:  # not under `tpe-launch supervise`: the exit code says it all
            return EXIT_PREEMPTED if outcome == "preempted" else rc
        try:
            write_node_status(Path(status), self.env, outcome, rc, stopped, self.ranks)
        except OSError as err:
            log.error(f"cannot record this node's outcome in {status} ({err}); failing the step")
            return rc or 1
        # preempted: 0, so that srun --kill-on-bad-exit does not stop the nodes still finishing their part
        return 0 if outcome == "preempted" else rc


def _read_code(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def write_node_status(
    directory: Path, env: Mapping[str, str], outcome: str, rc: int, stopped: int, ranks: int
) -> None:
    """``node-<SLURM_NODEID>.json`` in the job's status directory, written whole (rename)."""
    node = env.get("SLURM_NODEID", "0")
    record = {
        "node": int(node),
        "host": env.get("SLURMD_NODENAME") or socket.gethostname(),
        "outcome": outcome,  # done | preempted | failed
        "exit": rc,  # of the node's accelerate launch
        "ranks": ranks,
        "preempted_ranks": stopped,
        "ended_unix": round(time.time(), 3),
    }
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".node-{node}.json.tmp"
    tmp.write_text(json.dumps(record) + "\n")
    tmp.rename(directory / f"node-{node}.json")


def run_node(cmd: Sequence[str], env: Mapping[str, str], ranks: int = 1) -> int:
    """Run this node's launch (``ranks`` processes) to its end. Its exit code: 0 done; the launch's
    code when it failed; when every rank checkpointed and exited 75, 75, or 0 under ``tpe-launch
    supervise`` (``TPE_JOB_STATUS_DIR``), which then learns it from the node's status record."""
    return NodeRun(cmd, env, in_step=bool(env.get("SLURM_STEP_ID")), ranks=ranks).run()


class JobSupervisor:
    """The batch step: runs ``srun ...``, forwards SIGUSR1 to it, and after it requeues the job when the
    nodes' status records say they were preempted (``status_root``: a directory on the shared file
    system; without it, srun's exit code 75 alone means preempted, as for a single task)."""

    def __init__(self, cmd: Sequence[str], env: Mapping[str, str], status_root: Path | None = None) -> None:
        self.cmd, self.env = list(cmd), dict(env)
        self.child: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.usr1 = False  # asked to checkpoint and stop (Slurm's --signal=B:USR1@N, or by hand)
        self.forwarded = False
        self.term = False  # cancelled or out of time: no requeue
        job = env.get("SLURM_JOB_ID")
        self.status: Path | None = None
        if status_root is not None and job:
            attempt = f"job-{job}-{env.get('SLURM_RESTART_COUNT') or 0}"
            self.status = Path(status_root) / STATUS_DIR / attempt

    def _on_usr1(self, signum: int, frame: FrameType | None) -> None:
        self.usr1 = True
        log.info("SIGUSR1: asking the trainers to checkpoint and stop")

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        self.term = True

    def run(self) -> int:
        signal.signal(signal.SIGUSR1, self._on_usr1)
        signal.signal(signal.SIGTERM, self._on_term)
        restart = self.env.get("SLURM_RESTART_COUNT")
        if restart and restart != "0":
            job = self.env.get("SLURM_JOB_ID")
            log.info(f"restart {restart} of job {job}: the trainer resumes from latest")
        env = dict(self.env)
        if self.status is not None:
            shutil.rmtree(self.status, ignore_errors=True)  # an attempt of the same number never ran to here
            self.status.mkdir(parents=True)
            env[JOB_STATUS] = str(self.status)
        self.child = subprocess.Popen(self.cmd, env=env)
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
        return self.finish(rc)

    def node_records(self) -> list[dict[str, object]]:
        """The nodes' status records, in the order they ended (read by name: a directory listing
        can be stale on NFS, an open of a name this host never looked up is not)."""
        if self.status is None:
            return []
        nodes = int(self.env.get("SLURM_NNODES") or self.env.get("SLURM_JOB_NUM_NODES") or 1)
        found = []
        for node in range(nodes):
            try:
                found.append(json.loads((self.status / f"node-{node}.json").read_text()))
            except (OSError, ValueError):
                continue
        return sorted(found, key=lambda r: float(str(r.get("ended_unix", 0))))

    def finish(self, rc: int) -> int:
        """Decide from srun's exit code and the nodes' records: requeue, success or failure."""
        records = self.node_records()
        for r in records:
            log.info(f"node {r['node']} ({r['host']}): {r['outcome']} (launch exit {r['exit']}, "
                     f"{r['preempted_ranks']} of {r['ranks']} ranks exited {EXIT_PREEMPTED})")  # fmt: skip
        if self.status is not None:
            shutil.rmtree(self.status, ignore_errors=True)  # (its parent stays: other jobs may use it)
        if self.status is not None:  # the nodes' records decide; srun's code only says whether one failed
            preempted = rc == 0 and any(r["outcome"] == "preempted" for r in records)
        else:  # a single task run without status records: 75 is its own word for it
            preempted = rc == EXIT_PREEMPTED
        if preempted and not self.term:
            return self.requeue()
        if preempted:
            log.info("the trainers checkpointed after SIGTERM (cancelled or out of time): not requeued; "
                     "submit the same command again to resume from latest")  # fmt: skip
            return EXIT_PREEMPTED
        if rc != 0:
            failed = [f"node {r['node']} ({r['host']})" for r in records if r["outcome"] == "failed"]
            where = f" ({', '.join(failed)} failed; srun stopped the others)" if failed else ""
            log.error(f"the launch failed with exit code {rc}{where}")
        return rc

    def requeue(self) -> int:
        job = self.env.get("SLURM_JOB_ID")
        if not job:
            log.info("the trainer checkpointed and stopped (75); run the same command again to resume")
            return EXIT_PREEMPTED
        proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, env=self.env)
        if proc.returncode != 0:
            log.warning(
                f"the trainer checkpointed and stopped, but `scontrol requeue {job}` failed "
                f"({proc.stderr.strip()}); submit the same command again to resume from latest"
            )
            return EXIT_PREEMPTED
        log.info(f"checkpointed; job {job} requeued, it resumes from latest when it starts again")
        return 0


def supervise_job(cmd: Sequence[str], env: Mapping[str, str], status_root: Path | None = None) -> int:
    return JobSupervisor(cmd, env, status_root).run()
