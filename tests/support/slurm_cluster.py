"""A real, throwaway Slurm cluster on this host for the launch tests: munged, slurmctld, two slurmd.

``SlurmCluster`` follows the verified recipe in shared/design/slurm-local-cluster.md: two nodes
``n1``, ``n2`` (``NodeName=n[1-2]``, one slurmd port each) on 127.0.0.1, state, spool, logs and pid files
under one directory, ``SLURM_CONF`` pointing at our own ``slurm.conf`` (nothing under /etc/slurm is
touched; only a marked line in /etc/hosts so that the node names resolve, removed again on stop).
The daemons are stopped by the pids they wrote, never by name.

Run as root. Used by ``tests/test_slurm.py`` through a session fixture, only when ``TPE_TEST_SLURM=1``
(it changes the host: packages, /etc/hosts, daemons); also usable by hand:

    python tests/support/slurm_cluster.py up /tmp/slurmlocal      # prints the SLURM_CONF to export
    python tests/support/slurm_cluster.py down /tmp/slurmlocal
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
ENABLE = "TPE_TEST_SLURM"  # the tests that start the cluster run only when this is 1
HOSTS_MARK = "# tpe-train slurm test cluster"
MUNGE_PID = Path("/run/munge/munged.pid")


def ensure_installed() -> None:
    """Install Debian's Slurm and munge packages unless their programs are already there."""
    needed = ("slurmctld", "slurmd", "sbatch", "munged")
    if all(shutil.which(p) or Path(f"/usr/sbin/{p}").exists() for p in needed):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, capture_output=True)
    subprocess.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES],
        check=True,
        env=env,
        capture_output=True,
    )


def free_port_run(count: int, low: int = 12000, high: int = 15000) -> int:
    """The first of ``count`` consecutive TCP ports free right now, below the launcher's job ports
    (20000-29999) and the ephemeral range; the daemons bind them a moment later."""
    for base in range(low, high - count):
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return base
    raise RuntimeError(f"no {count} consecutive free ports in {low}-{high}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class SlurmCluster:
    """Two (or ``nodes``) slurmd on localhost under ``base``; ``start()`` / ``stop()``."""

    base: Path
    nodes: int = 2
    cpus: int = 2
    gpus: int = 2  # fake GPUs per node (GRES on /dev/null devices): GPU jobs schedule, nothing runs on them
    started: list[int] = field(default_factory=list)  # pids of the daemons we started

    @property
    def conf(self) -> Path:
        return self.base / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment for client commands (sbatch, squeue, ...) and the jobs they submit."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    @property
    def node_names(self) -> list[str]:
        return [f"n{i}" for i in range(1, self.nodes + 1)]

    def write_conf(self) -> None:
        b = self.base
        for sub in ("state", "log", "run", *(f"spool/{n}" for n in self.node_names)):
            (b / sub).mkdir(parents=True, exist_ok=True)  # slurmd does not create its spool dir
        gres = ""
        if self.gpus:
            (b / "dev").mkdir(exist_ok=True)
            for i in range(self.gpus):
                dev = b / "dev" / f"fakegpu{i}"
                if not dev.exists():
                    os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # the device of /dev/null
            last = self.gpus - 1
            (b / "gres.conf").write_text(
                f"NodeName=n[1-{self.nodes}] Name=gpu File={b}/dev/fakegpu[0-{last}]\n"
            )
            gres = f" Gres=gpu:{self.gpus}"
        ctld_port = free_port_run(1 + self.nodes)
        first = ctld_port + 1  # Port=[a-b]: one slurmd port per node, consecutive
        host = socket.gethostname().split(".")[0]
        self.conf.write_text(
            f"""ClusterName=tpeci
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
StateSaveLocation={b}/state
SlurmdSpoolDir={b}/spool/%n
SlurmctldPidFile={b}/run/slurmctld.pid
SlurmdPidFile={b}/run/slurmd-%n.pid
SlurmctldLogFile={b}/log/slurmctld.log
SlurmdLogFile={b}/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait=5
MinJobAge=600
NodeName=n[1-{self.nodes}] NodeHostname={host} NodeAddr=127.0.0.1 Port=[{first}-{first + self.nodes - 1}] \
CPUs={self.cpus} RealMemory=1000 Feature=tpe,cpu{gres} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
{"GresTypes=gpu" if self.gpus else ""}
"""
        )

    def _add_hosts(self) -> None:
        hosts = Path("/etc/hosts")
        text = hosts.read_text()
        if HOSTS_MARK not in text:
            line = f"127.0.0.1 {' '.join(self.node_names)}  {HOSTS_MARK}\n"
            hosts.write_text(text + ("" if text.endswith("\n") else "\n") + line)

    def _remove_hosts(self) -> None:
        hosts = Path("/etc/hosts")
        lines = hosts.read_text().splitlines(keepends=True)
        kept = [line for line in lines if HOSTS_MARK not in line]
        if len(kept) != len(lines):
            hosts.write_text("".join(kept))

    def start(self, timeout: float = 60.0) -> None:
        """Write the config, start munged (unless one runs), slurmctld and the slurmd; wait until idle."""
        self.write_conf()  # first: a bad base directory fails before anything is installed
        ensure_installed()
        self._add_hosts()
        env = self.env
        munge = _read_pid(MUNGE_PID)
        if munge is None or not _alive(munge):
            if not Path("/etc/munge/munge.key").exists():
                subprocess.run(["runuser", "-u", "munge", "--", "mungekey", "--create"], check=True)
            Path("/run/munge").mkdir(parents=True, exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True)
            self._wait_pid(MUNGE_PID, "munged")
        run = self.base / "run"
        subprocess.run(["slurmctld", "-c", "-f", str(self.conf)], check=True, env=env)
        self._wait_pid(run / "slurmctld.pid", "slurmctld")
        for node in self.node_names:
            subprocess.run(["slurmd", "-N", node, "-f", str(self.conf)], check=True, env=env)
            self._wait_pid(run / f"slurmd-{node}.pid", f"slurmd {node}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"], env=env, capture_output=True, text=True
            ).stdout
            if len(set(out.split())) >= self.nodes:
                return
            time.sleep(0.2)
        raise RuntimeError(f"Slurm nodes not idle after {timeout:.0f} s:\n{self.logs()}")

    def _wait_pid(self, path: Path, name: str) -> None:
        for _ in range(100):
            pid = _read_pid(path)
            if pid is not None and _alive(pid):
                self.started.append(pid)
                return
            time.sleep(0.1)
        raise RuntimeError(f"{name} did not start (no live pid in {path}):\n{self.logs()}")

    def stop(self) -> None:
        """Cancel leftover jobs, stop exactly the daemons we started (by pid), undo /etc/hosts."""
        env = self.env
        if self.started:  # a cluster that never started has no jobs (and maybe no squeue)
            squeue = ["squeue", "-h", "-o", "%A"]
            jobs = subprocess.run(squeue, env=env, capture_output=True, text=True).stdout.split()
            if jobs:
                subprocess.run(["scancel", *jobs], env=env, capture_output=True)
                time.sleep(1)
        for pid in self.started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(p) for p in self.started):
            time.sleep(0.1)
        for pid in self.started:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.started.clear()
        self._remove_hosts()

    def logs(self, lines: int = 30) -> str:
        out = []
        for path in sorted((self.base / "log").glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"== {path.name}\n" + "\n".join(tail))
        return "\n".join(out)

    # -- client helpers --------------------------------------------------------------------------

    def run(self, *args: str, check: bool = True) -> str:
        """A client command (``scontrol``, ``squeue``, ...) against this cluster; its stdout."""
        proc = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=60)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
        return proc.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol -o show job`` as a mapping (the first record: a plain job or one array task)."""
        line = self.run("scontrol", "-o", "show", "job", job_id).splitlines()[0]
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def jobs(self, job_id: str) -> list[dict[str, str]]:
        """Every record of ``job_id`` (the tasks of an array)."""
        lines = self.run("scontrol", "-o", "show", "job", job_id).splitlines()
        return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in lines if line.strip()]

    def wait(self, job_id: str, timeout: float) -> list[dict[str, str]]:
        """Poll (0.3 s) until no task of ``job_id`` is pending or running; the final records."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.run("squeue", "-h", "-j", job_id, check=False).strip():
                return self.jobs(job_id)
            time.sleep(0.3)
        self.run("scancel", job_id, check=False)
        raise TimeoutError(f"job {job_id} still queued or running after {timeout:.0f} s: {self.jobs(job_id)}")


def slurm_requested(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for the Slurm tests (``TPE_TEST_SLURM=1``)."""
    return env.get(ENABLE, "").strip() == "1"


def require_slurm(env: Mapping[str, str] = os.environ) -> None:
    """Skip the calling test, naming ``TPE_TEST_SLURM``, unless the environment asks for Slurm."""
    if not slurm_requested(env):
        pytest.skip(
            f"the Slurm tests change the host (packages, /etc/hosts, root daemons); set {ENABLE}=1 to run "
            "them (CI's .ci/run does)"
        )


def start_or_fail(cluster: SlurmCluster) -> None:
    """Start the cluster; when it cannot start, fail the test (asked for, so not a skip) with the cause."""
    try:
        cluster.start()
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", None) or ""
        if isinstance(detail, bytes):
            detail = detail.decode(errors="replace")
        pytest.fail(
            f"{ENABLE}=1 asks for the Slurm tests, but the local Slurm cluster did not start: {err} {detail}"
            f"\nThey need root and Debian's {' '.join(PACKAGES)}; unset {ENABLE} to skip them.",
            pytrace=False,
        )


@pytest.fixture(scope="session", name="slurm")
def slurm_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A running two-node cluster for the whole session; its daemons stopped (by pid) afterwards.

    Starting it changes the host (apt-get install when Slurm is missing, a line in /etc/hosts, daemons
    as root), so it runs only when ``TPE_TEST_SLURM=1`` asks for it; otherwise every test that needs
    it skips, naming the variable. Once asked for, a cluster that cannot start fails those tests."""
    require_slurm()
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        start_or_fail(cluster)
        yield cluster
    finally:
        cluster.stop()


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("up", "down"):
        print(__doc__, file=sys.stderr)
        return 2
    cluster = SlurmCluster(Path(argv[1]))
    if argv[0] == "up":
        cluster.start()
        print(f"export SLURM_CONF={cluster.conf}")
        return 0
    # by hand: the pids come from the pid files the daemons wrote (munged's too: `up` started it)
    run = cluster.base / "run"
    for path in [run / "slurmctld.pid", *run.glob("slurmd-*.pid"), MUNGE_PID]:
        pid = _read_pid(path)
        if pid is not None and _alive(pid):
            cluster.started.append(pid)
    cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
