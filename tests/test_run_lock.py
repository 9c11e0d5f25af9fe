"""One run per run directory: a second tpe-train (or tpe-study) on it stops before any work and leaves
the first one's files alone; a lock whose owner died never blocks the rerun; the ranks of a refused
launch all stop; the mount table tells where flock may not reach other machines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_checkpoints import SMALL, samples, steps_of, train

from tpe_train.run.lock import LOCK_NAME, RunDirBusy, RunLock, scope_warning

pytestmark = pytest.mark.integration  # every test here starts the project's commands

ROOT = Path(__file__).resolve().parents[1]


def start(run_dir: Path, *overrides: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "tpe_train.train", *SMALL, f"train.run_dir={run_dir}", *overrides]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_until(done: object, proc: subprocess.Popen[str], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not done():  # type: ignore[operator]
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)


def owner_pid(directory: Path) -> int | None:
    try:
        return int(json.loads((directory / LOCK_NAME).read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``directory`` with its size and modification time."""
    return {
        str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in directory.rglob("*")
        if p.is_file()
    }


def test_a_second_run_is_refused_and_the_first_keeps_its_files(tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = start(run, "train.max_steps=4", "train.save_every=2")
    wait_until(lambda: owner_pid(run) == first.pid, first)
    first.send_signal(signal.SIGSTOP)  # the owner holds the lock but makes no progress meanwhile
    try:
        before = snapshot(run)
        second = train(run, "train.max_steps=4", "train.save_every=1", "train.seed=2", check=False)
        assert snapshot(run) == before  # stopped before any work: not a byte written
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-3000:]
    assert f"is in use by another run: pid {first.pid} on host " in second.stderr
    assert (
        f"holds its lock {run / LOCK_NAME}" in second.stderr and "run the same command again" in second.stderr
    )
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    # everything in the run directory is the first run's: config, checkpoints, batches, events, export
    assert "seed: 1\n" in (run / "config.yaml").read_text()
    assert steps_of(run) == [2, 4]
    assert [s["step"] for s in samples(run)] == [1, 2, 3, 4]
    assert len(list((run / "tb").glob("events.out.tfevents.*"))) == 1
    assert json.loads((run / "checkpoint" / "meta.json").read_text())["step"] == 4
    assert owner_pid(run) == first.pid  # the record names the last owner; the lock itself is free


def test_a_killed_owner_does_not_block_the_rerun(tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = start(run, "train.max_steps=400")
    wait_until(lambda: owner_pid(run) == first.pid, first)
    first.kill()  # SIGKILL: no handler, no cleanup; the kernel drops its flock
    first.wait(timeout=60)
    rerun = train(run, "train.max_steps=2")  # (resuming after a kill: tests/test_resume_distributed.py)
    assert rerun.returncode == 0 and steps_of(run) == [2]
    assert owner_pid(run) not in (None, first.pid)  # the rerun took the lock over


def test_every_rank_of_a_refused_launch_stops(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with RunLock(run):  # this test process owns the directory
        proc = subprocess.run(
            [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
             str(ROOT / "configs" / "accelerate" / "cpu_ddp.yaml"), "-m", "tpe_train.train", *SMALL,
             f"train.run_dir={run}"],
            cwd=ROOT, env={**os.environ, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
    # both ranks ended (the launcher returned), rank 0 with the message, rank 1 without waiting for it
    assert proc.returncode != 0
    assert proc.stderr.count(f"is in use by another run: pid {os.getpid()}") == 1, proc.stderr[-3000:]
    assert "RunDirBusy" not in proc.stderr  # reported, not raised (accelerate's own failure report follows)
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]


def test_tpe_study_run_twice_on_one_directory_refuses_the_second(tmp_path: Path) -> None:
    out = tmp_path / "study"
    cmd = [sys.executable, "-m", "tpe_train.study.cli", "run", "--encodings", "sinusoidal", "--seeds", "1",
           "--out", str(out), *SMALL, "train.max_steps=400"]  # fmt: skip
    first = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        wait_until(lambda: owner_pid(out) == first.pid, first)
        os.killpg(first.pid, signal.SIGSTOP)  # the study and the run it started
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
    assert second.returncode == 2 and "Traceback" not in second.stderr
    assert f"tpe-study run: error: {out} is in use by another run: pid {first.pid}" in second.stderr
    assert "pass another --out" in second.stderr


def test_a_lock_is_one_owner_at_a_time_in_one_process_too(tmp_path: Path) -> None:
    with RunLock(tmp_path), pytest.raises(RunDirBusy, match=f"pid {os.getpid()} on host"):
        RunLock(tmp_path).acquire()
    with RunLock(tmp_path):  # released: free again
        pass


MOUNTS = """\
/dev/sda1 / ext4 rw,relatime 0 0
srv:/home /home nfs4 rw,vers=4.2,local_lock=none,addr=10.0.0.1 0 0
srv:/old /old nfs rw,vers=3,nolock,addr=10.0.0.1 0 0
srv:/scratch /scratch nfs4 rw,vers=4.1,local_lock=flock 0 0
mds@tcp:/lus /lustre lustre rw,flock 0 0
mds@tcp:/lus2 /lustre2 lustre rw,localflock 0 0
gpfs1 /gpfs gpfs rw 0 0
"""


@pytest.mark.parametrize(
    "path, expected",
    [
        ("/tmp/run", None),  # a local disk
        ("/home/me/run", None),  # NFS with server-side locks
        ("/old/run", "mounted with nolock: its locks are local to each machine"),
        ("/scratch/me/run", "mounted with local_lock=flock: its locks are local to each machine"),
        ("/lustre/run", None),
        ("/lustre2/run", "its flock is local to each client (localflock)"),
        ("/gpfs/run", "a GPFS / Storage Scale file system: whether its flock reaches other machines"),
    ],
)
def test_the_mount_table_says_where_flock_may_stay_on_one_node(path: str, expected: str | None) -> None:
    warning = scope_warning(Path(path), MOUNTS)
    assert warning is None if expected is None else expected in (warning or "")
