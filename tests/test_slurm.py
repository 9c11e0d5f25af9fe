"""The launch layer on a real Slurm cluster: two slurmd on this host (tests/support/slurm_cluster.py),
the real templates of slurm/, ``tpe-launch submit``, CPU processes over gloo.

Each job trains the demo preset for a few steps on a tiny corpus; the token store lives in the
test's temporary directory (``TPE_DATA_CACHE``).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.slurm_cluster import SlurmCluster, slurm_fixture  # noqa: F401  (the session fixture `slurm`)

pytestmark = pytest.mark.integration  # every test here starts the project's commands

TINY = [
    "data.synthetic.train_size=1500",
    "data.synthetic.valid_size=20",
    "data.synthetic.test_size=30",
    "data.synthetic.long_size=10",
    "data.synthetic.probe_size=10",
    "data.max_tokens=1024",
    "eval.at_end=false",
    "train.valid_bleu_size=0",
    "train.progress=false",
    "train.threads=1",
]
JOB_TIMEOUT = 240  # seconds; every job also has a Slurm time limit (a hung rendezvous cannot hang CI)


def submit(slurm: SlurmCluster, tmp: Path, *argv: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """``tpe-launch submit`` against the test cluster (``env``: more for the job's environment); its
    report as a mapping (job, log, run dir ...)."""
    env = {**slurm.env, "TPE_DATA_CACHE": str(tmp / "data-cache"), **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "submit", "--time", "10", "--signal-before", "60", *argv],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return dict(line.split(": ", 1) for line in proc.stdout.splitlines())


def log_of(report: dict[str, str], index: int | None = None) -> str:
    path = report["log"].replace("<index>", str(index))
    return Path(path).read_text(errors="replace") if Path(path).exists() else f"(no log at {path})"


def assert_completed(record: dict[str, str], log: str) -> None:
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]


def test_launcher_task_per_node_sees_its_rank_and_the_first_host(slurm: SlurmCluster) -> None:
    env = {k: v for k, v in slurm.env.items() if k != "DS_ACCELERATOR"}  # the dry run prints what it adds
    out = subprocess.run(
        ["srun", "--nodes=2", "--ntasks-per-node=1", "--time=1", sys.executable, "-m", "launcher.cli",
         "run", "--dry-run", "--preset", "demo", "train.max_steps=4"],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    first = slurm.run("scontrol", "show", "hostnames", "n[1-2]").split()[0]
    commands = [shlex.split(line) for line in out.splitlines() if not line.startswith("#")]
    ranks = sorted(c[c.index("--machine_rank") + 1] for c in commands)
    assert ranks == ["0", "1"]
    for cmd in commands:
        assert cmd[cmd.index("--main_process_ip") + 1] == first == "n1"
        assert cmd[cmd.index("--num_machines") + 1] == "2"
        assert cmd[cmd.index("--num_processes") + 1] == "2"  # one CPU process per node
        assert "DS_ACCELERATOR=cpu" in cmd
    assert len({c[c.index("--main_process_port") + 1] for c in commands}) == 1


@pytest.fixture(scope="module")
def two_node_run(
    slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, str]]:
    """A 2-node job of 4 steps over gloo, saving every 2 steps: (its run dir, its submit report)."""
    tmp = tmp_path_factory.mktemp("two-node")
    run = tmp / "run"
    report = submit(slurm, tmp, "--nodes", "2", "--cpus-per-node", "1", *TINY, "train.max_steps=4",
                    "train.save_every=2", f"train.run_dir={run}")  # fmt: skip
    assert report["run dir"] == str(run)
    (record,) = slurm.wait(report["job"], JOB_TIMEOUT)
    report["record"] = json.dumps(record)
    return run, report


def test_two_node_job_trains_over_gloo_and_checkpoints(two_node_run: tuple[Path, dict[str, str]]) -> None:
    run, report = two_node_run
    record = json.loads(report["record"])
    log = log_of(report)
    assert_completed(record, log)
    assert record["NumNodes"] == "2"
    assert "--machine_rank 0" in log and "--machine_rank 1" in log and "--main_process_ip n1" in log
    assert "world 2 = data-parallel 2" in log  # both nodes' ranks trained together
    for step in (2, 4):
        assert (run / "checkpoints" / f"step-{step:08d}" / "manifest.json").is_file()
    assert (run / "checkpoint" / "model.safetensors").is_file()
    assert list((run / "tb").glob("events.out.tfevents.*"))


def test_eval_job_averages_the_last_checkpoints(
    slurm: SlurmCluster, two_node_run: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    run, _ = two_node_run
    report = submit(slurm, tmp_path, "--script", "eval", "--last", "2", *TINY, f"train.run_dir={run}")
    out = run / "averaged-last2"
    assert report["averaged"] == str(out)
    (record,) = slurm.wait(report["job"], JOB_TIMEOUT)
    log = log_of(report)
    assert_completed(record, log)
    assert "averaged step-00000002, step-00000004" in log
    metrics = json.loads((out / "eval.json").read_text())
    assert metrics["test_sentences"] == 30 and "bleu" in metrics and "probe_accuracy" in metrics


def test_array_trains_two_encodings_into_their_own_run_dirs(slurm: SlurmCluster, tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    report = submit(slurm, tmp_path, "--script", "sweep_positions", "--array", "1,6", "--sweep-root",
                    str(root), *TINY, "train.max_steps=3")  # fmt: skip
    assert report["run dir [1] sinusoidal"] == str(root / "sinusoidal")
    assert report["run dir [6] rope"] == str(root / "rope")
    records = slurm.wait(report["job"], JOB_TIMEOUT)
    assert sorted(r["ArrayTaskId"] for r in records) == ["1", "6"]
    for record in records:
        index = int(record["ArrayTaskId"])
        assert_completed(record, log_of(report, index))
        kind = {1: "sinusoidal", 6: "rope"}[index]
        run = root / kind
        assert f"kind: {kind}" in (run / "config.yaml").read_text()
        assert f"position {kind}" in log_of(report, index)
        assert list((run / "tb").glob("events.out.tfevents.*"))  # one TensorBoard run per encoding
        assert (run / "checkpoint" / "model.safetensors").is_file()


def preempt_when_training(slurm: SlurmCluster, report: dict[str, str], run: Path) -> None:
    """Wait until rank 0 has trained 2 steps, then send Slurm's warning signal to the batch step, as
    --signal=B:USR1@N would."""
    job, samples = report["job"], run / "samples" / "rank-00000.jsonl"
    deadline = time.monotonic() + JOB_TIMEOUT
    while not (samples.exists() and len(samples.read_text().splitlines()) >= 2):
        state = slurm.job(job)["JobState"]
        assert time.monotonic() < deadline and state in ("PENDING", "RUNNING"), log_of(report)
        time.sleep(0.2)
    slurm.run("scancel", "--batch", "--signal=USR1", job)


def node_outcomes(log: str) -> list[tuple[str, str]]:
    """(host, outcome) of each node as `tpe-launch supervise` reports them, in the order they ended."""
    return re.findall(r"tpe-launch: node \d \((n\d)\): (\w+) \(launch exit", log)


# TEST-ONLY hook of the trainer (tpe_train/exits.py): rank 0 (on n1) waits 8 s after its preemption
# checkpoint before it exits, so that n2's task always ends first -- the order in which srun
# --kill-on-bad-exit used to terminate n1 and fail the job instead of requeueing it. (n2's step was
# done about 1 s after its rank exited, on a loaded 2-core machine: 8 s leaves a wide margin.)
N1_EXITS_LAST = {"TPE_TEST_EXIT": "0:8"}


def test_usr1_checkpoints_requeues_and_resumes(slurm: SlurmCluster, tmp_path: Path) -> None:
    """Slurm's warning signal reaches the batch step; the trainers checkpoint and exit 75, n2 first
    and n1 8 s later; the job is requeued and finishes from its checkpoint: all steps trained, none
    twice, whichever node ended first."""
    run, steps = tmp_path / "run", 20
    report = submit(slurm, tmp_path, "--nodes", "2", "--cpus-per-node", "1", *TINY,
                    f"train.max_steps={steps}", "train.log_samples=true", f"train.run_dir={run}",
                    env=N1_EXITS_LAST)  # fmt: skip
    preempt_when_training(slurm, report, run)
    # the requeued job waits for its BeginTime (AuthInfo=cred_expire=10 in the test cluster); forcing
    # StartTime=now races the revoked credential of the first run and kills the restart
    (record,) = slurm.wait(report["job"], JOB_TIMEOUT)
    log = log_of(report)
    assert_completed(record, log)
    assert record["Restarts"] == "1"
    assert node_outcomes(log)[:2] == [("n2", "preempted"), ("n1", "preempted")], log[-4000:]
    stopped = json.loads((run / "preempted.json").read_text())["step"]
    assert 2 <= stopped < steps, log
    assert f"preempted at step {stopped}" in log and "requeued" in log
    assert re.search(rf"resumed from \S*step-{stopped:08d} at step {stopped}\b", log), log[-4000:]
    for rank in (0, 1):
        trained = [json.loads(line)["step"] for line in (run / "samples" / f"rank-{rank:05d}.jsonl").open()]
        assert trained == list(range(1, steps + 1))  # every step once, none repeated after the restart
    assert json.loads((run / "checkpoint" / "meta.json").read_text())["step"] == steps
    assert not list((run / ".tpe-launch").iterdir())  # the status records of both attempts are gone


def test_a_real_failure_during_a_preemption_fails_the_job_and_stops_the_other_node(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """n2 fails (exit 1 instead of 75) right after the checkpoint while n1 would wait 10 minutes before
    exiting (TEST-ONLY hook): srun stops n1 at once, the job ends FAILED and is not requeued. (A node
    that fails after the others were preempted: tests/test_launch.py, the node and supervise parts.)"""
    run = tmp_path / "run"
    report = submit(slurm, tmp_path, "--nodes", "2", "--cpus-per-node", "1", *TINY, "train.max_steps=400",
                    "train.log_samples=true", f"train.run_dir={run}",
                    env={"TPE_TEST_EXIT": "0:600,1:0:1"})  # fmt: skip
    preempt_when_training(slurm, report, run)
    (record,) = slurm.wait(report["job"], JOB_TIMEOUT)  # n1 left waiting 600 s would time this out
    log = log_of(report)
    assert record["JobState"] == "FAILED" and record.get("Restarts", "0") == "0", log[-4000:]
    assert "requeued" not in log
    assert dict(node_outcomes(log)) == {"n2": "failed"}, log[-4000:]  # n1 was stopped before it could say
    assert "n1: task 0: Killed" in log or "n1: task 0: Terminated" in log, log[-4000:]
    assert "the launch failed with exit code" in log and "node 1 (n2) failed; srun stopped the others" in log


def test_a_failing_trainer_fails_the_job(slurm: SlurmCluster, tmp_path: Path) -> None:
    # valid configuration (submit accepts it), but every rank stops at start-up with exit code 2
    missing = tmp_path / "no-such-checkpoint"
    report = submit(slurm, tmp_path, "--nodes", "2", "--cpus-per-node", "1", *TINY,
                    f"train.run_dir={tmp_path / 'run'}", f"train.resume={missing}")  # fmt: skip
    (record,) = slurm.wait(report["job"], JOB_TIMEOUT)
    log = log_of(report)
    assert record["JobState"] == "FAILED", log[-4000:]
    assert record["ExitCode"] != "0:0" and record.get("Restarts", "0") == "0"
    assert "no-such-checkpoint" in log  # the trainer's own message is in the job's log
    assert "the launch failed" in log


@pytest.mark.parametrize("nodes", ["0", "-1"])
def test_bad_resources_are_refused_before_sbatch(slurm: SlurmCluster, tmp_path: Path, nodes: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "submit", "--nodes", nodes],
        cwd=tmp_path,
        env=slurm.env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "--nodes must be at least 1" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not slurm.run("squeue", "-h").strip()  # nothing was submitted


def test_site_options_and_setup_reach_the_job(slurm: SlurmCluster, tmp_path: Path) -> None:
    """A site file (set-up, mail, QOS) under flags (memory, node feature, whole node, any other option):
    each shows in `scontrol show job`, the set-up runs in the job before the launch, and the run trains."""
    marker = tmp_path / "setup-ran"
    setup = tmp_path / "site setup.sh"
    setup.write_text(f'echo "$SLURM_JOB_ID" > {shlex.quote(str(marker))}\nexport TPE_SITE_SETUP=1\n')
    site = tmp_path / "slurm.yaml"
    site.write_text(f"mail-type: END,FAIL\nmail-user: me@lab.org\nsetup: {setup.name!r}\nqos: normal\n")
    run = tmp_path / "run"
    report = submit(slurm, tmp_path, "--mem", "500M", "--constraint", "tpe", "--exclusive", "--sbatch",
                    "comment=site test", *TINY, "train.max_steps=2", f"train.run_dir={run}",
                    env={"TPE_SLURM_CONFIG": str(site)})  # fmt: skip
    job = slurm.run("scontrol", "show", "job", report["job"])
    assert "MailUser=me@lab.org MailType=END,FAIL" in job, job
    assert "MinMemoryNode=500M" in job and "Features=tpe" in job and "OverSubscribe=NO" in job, job
    assert "Comment=site test" in job, job
    (record,) = slurm.wait(report["job"], JOB_TIMEOUT)
    assert_completed(record, log_of(report))
    assert marker.read_text().strip() == report["job"]  # the set-up ran inside this job
    assert (run / "checkpoint" / "model.safetensors").is_file()  # and the launch after it


def test_a_gpu_job_asks_for_cpus_per_gpu_and_is_accepted(slurm: SlurmCluster, tmp_path: Path) -> None:
    """2 (fake) GPUs per node with 1 CPU each, held so that nothing runs on the fake devices: sbatch
    accepts the rendered script and the job carries the GPUs and the CPUs per GPU."""
    report = submit(slurm, tmp_path, "--gpus-per-node", "2", "--cpus-per-gpu", "1", "--sbatch", "hold",
                    f"train.run_dir={tmp_path / 'run'}")  # fmt: skip
    record = slurm.job(report["job"])
    try:
        assert record["JobState"] == "PENDING" and record["Reason"] == "JobHeldUser", record
        assert record["TresPerNode"] in ("gres:gpu:2", "gres/gpu:2"), record
        assert record["CpusPerTres"] in ("gres:gpu:1", "gres/gpu:1"), record
    finally:
        slurm.run("scancel", report["job"])
