"""The launch layer without Slurm: commands from a fake SLURM_* environment, templates, bad input,
and signal handling with real processes (tests/test_slurm.py runs the same on a real cluster)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support.slurm_cluster import SlurmCluster, require_slurm, slurm_requested, start_or_fail

from launcher.cli import main
from launcher.plan import (
    PLUGIN_GROUP,
    POSITION_SWEEP,
    ROOT,
    LaunchError,
    LaunchFile,
    LaunchPlan,
    NodeEnv,
    Resources,
    first_host,
    job_port,
    sweep_kind,
    sweep_kinds,
    sweep_overrides,
)
from launcher.submit import array_indices, render, time_seconds
from tpe_train.config import plugins
from tpe_train.positions import POSITIONS
from tpe_train.run.exits import EXIT_PREEMPTED


def slurm_env(**kw: str) -> dict[str, str]:
    env = {
        "SLURM_JOB_ID": "123456",
        "SLURM_NODEID": "2",
        "SLURM_NNODES": "4",
        "SLURM_JOB_NODELIST": "gpu[07-10]",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "4",
    }
    env.update(kw)
    return env


def fake_hostnames(nodelist: str) -> list[str]:
    """What ``scontrol show hostnames`` prints for the lists used here."""
    assert nodelist == "gpu[07-10]"
    return ["gpu07", "gpu08", "gpu09", "gpu10"]


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


# -- the command of one node ----------------------------------------------------------------------


def test_node_env_from_slurm() -> None:
    node = NodeEnv.from_env(slurm_env(SLURM_RESTART_COUNT="1"), fake_hostnames)
    assert (node.machine_rank, node.num_machines, node.main_ip) == (2, 4, "gpu07")
    assert node.port == 20000 + 123456 % 10000 == job_port("123456")
    assert node.restart == 1 and node.array_index is None


def test_outside_slurm_one_local_machine() -> None:
    node = NodeEnv.from_env({"PATH": "/bin"})
    assert (node.machine_rank, node.num_machines, node.main_ip, node.job_id) == (0, 1, "127.0.0.1", None)


def test_gpu_command_for_node_2_of_4() -> None:
    res = Resources.build(nodes=4, gpus_per_node=8)
    node = NodeEnv.from_env(slurm_env(), fake_hostnames)
    plan = LaunchPlan("demo", ["model.position.kind=rope"], res, LaunchFile.load("gpu_zero2"), node)
    cmd = plan.command()
    assert cmd[1] == "launch" and Path(cmd[0]).name == "accelerate"
    assert flag(cmd, "--config_file") == str(ROOT / "configs/accelerate/gpu_zero2.yaml")
    assert flag(cmd, "--num_machines") == "4"
    assert flag(cmd, "--machine_rank") == "2"
    assert flag(cmd, "--main_process_ip") == "gpu07"
    assert flag(cmd, "--main_process_port") == str(job_port("123456"))
    assert flag(cmd, "--num_processes") == "32"  # accelerate gives each machine 32 / 4 = 8
    assert flag(cmd, "--deepspeed_config_file") == str(ROOT / "configs/deepspeed/zero2.json")
    assert flag(cmd, "--deepspeed_multinode_launcher") == "standard"  # not pdsh over ssh
    assert cmd[cmd.index("-m") :] == ["-m", "tpe_train.train", "--preset", "demo", "model.position.kind=rope"]
    assert "DS_ACCELERATOR" not in plan.env({})


def test_cpu_command_uses_gloo_layouts_and_ds_accelerator() -> None:
    res = Resources.build(nodes=2, cpus_per_node=4, procs_per_node=2)
    node = NodeEnv.from_env(slurm_env(SLURM_NODEID="1", SLURM_NNODES="2", SLURM_STEP_NUM_TASKS="2"),
                            lambda _: ["n1", "n2"])  # fmt: skip
    ddp = LaunchPlan("demo", [], res, LaunchFile.default(res), node)
    cmd = ddp.command()
    assert ddp.layout.name == "cpu_ddp" and ddp.layout.use_cpu
    assert flag(cmd, "--num_processes") == "4" and flag(cmd, "--machine_rank") == "1"
    assert flag(cmd, "--main_process_ip") == "n1"
    assert flag(cmd, "--num_cpu_threads_per_process") == "2"
    assert "--deepspeed_multinode_launcher" not in cmd
    assert ddp.env({})["DS_ACCELERATOR"] == "cpu"
    zero2 = LaunchPlan("demo", [], res, LaunchFile.load("cpu_zero2"), node).command()
    assert flag(zero2, "--deepspeed_multinode_launcher") == "standard"
    single = Resources.build()
    assert LaunchFile.default(single).name == "cpu_single" and single.processes == 1


def test_one_gpu_trains_without_deepspeed_by_default() -> None:
    """ZeRO has nothing to partition on one rank: one GPU gets one plain process (``gpu_single``), more
    GPUs ZeRO-1; ``--layout gpu_zero1`` still asks for DeepSpeed on one GPU."""
    one, two = Resources.build(gpus_per_node=1), Resources.build(nodes=2, gpus_per_node=1)
    node = NodeEnv.from_env({"PATH": "/bin"})
    plan = LaunchPlan("demo", [], one, LaunchFile.default(one), node)
    cmd = plan.command()
    assert plan.layout.name == "gpu_single" and not plan.layout.deepspeed and not plan.layout.use_cpu
    assert Path(flag(cmd, "--config_file")).name == "gpu_single.yaml" and flag(cmd, "--num_processes") == "1"
    assert "--deepspeed_multinode_launcher" not in cmd and "DS_ACCELERATOR" not in plan.env({})
    assert LaunchFile.default(two).name == "gpu_zero1"
    asked = LaunchPlan("demo", [], one, LaunchFile.load("gpu_zero1"), node).command()
    assert Path(flag(asked, "--config_file")).name == "gpu_zero1.yaml"


def test_processes_per_node_follow_gpus_or_cpus() -> None:
    assert Resources.build(nodes=3, gpus_per_node=4).processes == 12
    assert Resources.build(nodes=2, cpus_per_node=8).procs_per_node == 8  # one per CPU asked for
    assert Resources.build(nodes=2, cpus_per_node=8, procs_per_node=2).procs_per_node == 2
    with pytest.raises(LaunchError, match="one process per GPU"):
        Resources.build(gpus_per_node=8, procs_per_node=4)
    with pytest.raises(LaunchError, match="--nodes must be at least 1"):
        Resources.build(nodes=0)
    with pytest.raises(LaunchError, match="at least one CPU per process"):
        Resources.build(cpus_per_node=2, procs_per_node=4)


def test_layouts_that_cannot_run_are_refused() -> None:
    cpu, gpu = Resources.build(nodes=2), Resources.build(gpus_per_node=2)
    with pytest.raises(LaunchError, match="runs on GPUs but no GPUs"):
        LaunchFile.load("gpu_zero1").check(cpu)
    with pytest.raises(LaunchError, match="runs on CPUs"):
        LaunchFile.load("cpu_ddp").check(gpu)
    with pytest.raises(LaunchError, match="starts one process but 2"):
        LaunchFile.load("cpu_single").check(cpu)
    with pytest.raises(LaunchError, match=r"not found.*cpu_ddp.*gpu_zero1"):
        LaunchFile.load("zero9")


def test_the_slurm_step_must_run_one_task_per_node() -> None:
    with pytest.raises(LaunchError, match="exactly one task per node"):
        NodeEnv.from_env(slurm_env(SLURM_STEP_NUM_TASKS="32"), fake_hostnames)
    node = NodeEnv.from_env(slurm_env(), fake_hostnames)
    with pytest.raises(LaunchError, match="SLURM_NNODES"):
        LaunchPlan("demo", [], Resources.build(nodes=2, gpus_per_node=8), LaunchFile.load("gpu_zero1"), node)


def test_first_host_of_a_node_list_without_scontrol() -> None:
    assert first_host("gpu[07-10,12],cpu3", hostnames=None) in ("gpu07",)
    assert first_host("n1", hostnames=lambda _: []) == "n1"
    assert first_host("node-a,node-b", hostnames=lambda _: []) == "node-a"
    assert first_host("rack[2-3]-gpu[1-4]", hostnames=lambda _: []) == "rack2"  # scontrol: rack2-gpu1
    assert first_host("x[1-2]", hostnames=lambda _: ["x1", "x2"]) == "x1"


def test_position_sweep_covers_every_registered_encoding() -> None:
    assert POSITION_SWEEP[:7] == ("none", "sinusoidal", "learned", "shaw", "t5", "alibi", "rope")
    assert set(POSITION_SWEEP) == set(POSITIONS.names())
    assert len(POSITION_SWEEP) == len(set(POSITION_SWEEP))
    assert [sweep_kind(i) for i in range(len(POSITION_SWEEP))] == list(POSITION_SWEEP)
    with pytest.raises(LaunchError, match="outside the position sweep"):
        sweep_kind(len(POSITION_SWEEP))
    with pytest.raises(LaunchError, match="SLURM_ARRAY_TASK_ID"):
        sweep_kind(None)
    assert sweep_kind(1, ("rope", "alibi")) == "alibi"
    for bad in ("rope,,alibi", "rope,rope", ""):
        with pytest.raises(LaunchError, match="distinct encoding names"):
            sweep_kinds(bad)
    assert PLUGIN_GROUP == plugins.GROUP  # the launcher reads the names the config loads
    assert sweep_overrides(["train.max_steps=4"], "t5", "/r") == [
        "train.max_steps=4",
        "model.position.kind=t5",
        "train.run_dir=/r/t5",
    ]
    with pytest.raises(LaunchError, match=r"sets model\.position\.kind"):
        sweep_overrides(["model.position.kind=rope"], "t5", "/r")


# -- submit: parsing, templates, dry run ----------------------------------------------------------


def test_time_limits_and_array_specs() -> None:
    assert time_seconds("30") == 1800
    assert time_seconds("10:30") == 630
    assert time_seconds("2:00:00") == 7200
    assert time_seconds("1-02") == 93600
    assert time_seconds("1-00:00:10") == 86410
    with pytest.raises(LaunchError, match="not a Slurm time limit"):
        time_seconds("2h")
    assert array_indices("0-6") == list(range(7))
    assert array_indices("1,4-6%2") == [1, 4, 5, 6]
    assert array_indices("0-6:3") == [0, 3, 6]


def test_render_fills_placeholders_and_drops_empty_lines() -> None:
    text = "a={{a}}\n{{gone}}\nb\n"
    assert render(text, {"a": "1", "gone": ""}) == "a=1\nb\n"
    with pytest.raises(LaunchError, match="without a value: gone"):
        render(text, {"a": "1"})


def test_templates_hold_no_logic() -> None:
    """Shell files: #SBATCH lines, comments, set/export, and one exec'd command (or two for eval)."""
    for path in (ROOT / "slurm").glob("*.sbatch"):
        for line in path.read_text().splitlines():
            assert not re.match(r"\s*(if|for|while|case|trap|function)\b|.*\$\(\(|.*\|\|", line), (path, line)


def test_slurm_tests_run_only_when_asked_and_fail_when_slurm_cannot_start(tmp_path: Path) -> None:
    """The Slurm tests change the host: without TPE_TEST_SLURM=1 they skip naming the variable; with it,
    a cluster that cannot start is a failure with its cause."""
    assert not slurm_requested({}) and not slurm_requested({"TPE_TEST_SLURM": "0"})
    assert slurm_requested({"TPE_TEST_SLURM": "1"})
    with pytest.raises(pytest.skip.Exception, match="set TPE_TEST_SLURM=1"):
        require_slurm({})
    require_slurm({"TPE_TEST_SLURM": "1"})  # asked for: no skip
    base = tmp_path / "not-a-folder"
    base.write_text("")  # the cluster's state cannot go under a file: start fails before any install
    cluster = SlurmCluster(base)
    with pytest.raises(pytest.fail.Exception, match=r"TPE_TEST_SLURM=1 asks for the Slurm tests.*not start"):
        start_or_fail(cluster)
    cluster.stop()  # nothing was started: nothing to stop, /etc/hosts untouched
    assert not cluster.started


def dry_run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["submit", *argv, "--dry-run"]) == 0
    return capsys.readouterr().out


def test_dry_run_4_nodes_x_8_gpus(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = dry_run(
        ["--preset", "demo", "--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu", "--account",
         "lab", "--time", "12:00:00", f"train.run_dir={tmp_path}/run"],
        capsys,
    )  # fmt: skip
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=?(.*)$", out, re.M))
    assert sbatch["nodes"] == "4"
    assert sbatch["ntasks-per-node"] == "1"  # one launcher per node; it starts the 8 processes
    assert sbatch["gpus-per-node"] == "8"
    assert sbatch["partition"] == "gpu" and sbatch["account"] == "lab" and sbatch["time"] == "12:00:00"
    assert sbatch["signal"] == "B:USR1@300" and "requeue" in sbatch
    assert sbatch["open-mode"] == "append"  # a requeued run appends to its log
    assert sbatch["output"] == f"{tmp_path}/run/slurm-%j.out"
    assert "srun --ntasks-per-node=1 --kill-on-bad-exit=1" in out
    assert "DS_ACCELERATOR" not in out
    nodes = re.findall(r"^#   node (\d+): (.*)$", out, re.M)
    assert [int(n) for n, _ in nodes] == [0, 1, 2, 3]
    for rank, line in nodes:
        cmd = shlex.split(line)
        assert flag(cmd, "--machine_rank") == rank
        assert flag(cmd, "--num_machines") == "4"
        assert flag(cmd, "--num_processes") == "32"  # 4 machines x 8 per node
        assert int(flag(cmd, "--num_processes")) // int(flag(cmd, "--num_machines")) == 8
        assert flag(cmd, "--main_process_ip") == "<first host of SLURM_JOB_NODELIST>"
        assert Path(flag(cmd, "--config_file")).name == "gpu_zero1.yaml"
        assert flag(cmd, "--deepspeed_multinode_launcher") == "standard"
    # what the batch script runs on each node is the same plan, from SLURM_* at run time
    run_line = out.split("tpe-launch run ", 1)[1].splitlines()[0]
    assert "--nodes 4" in run_line and "--gpus-per-node 8" in run_line and "--procs-per-node 8" in run_line


def test_sweep_kinds_pick_the_array_and_go_to_the_job(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    kinds = ["--script", "sweep_positions", "--kinds", "rope,alibi"]
    out = dry_run([*kinds, "--sweep-root", str(tmp_path)], capsys)
    assert "#SBATCH --array=0-1" in out and "#   0 rope 1 alibi" in out
    assert "--kinds rope,alibi" in out and f"# run dir [1] alibi: {tmp_path / 'alibi'}" in out
    # a kind that is no encoding, even outside --array: refused before anything is written
    assert main(["submit", *kinds[:3], "rope,nope", "--array", "0", "--dry-run"]) == 2
    assert "sweep element nope" in capsys.readouterr().err
    assert main(["submit", "--kinds", "rope", "--dry-run"]) == 2
    assert "--kinds applies to --script sweep_positions" in capsys.readouterr().err


def test_dry_run_cpu_sweep_and_eval(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = dry_run(["--script", "sweep_positions", "--array", "0,6", "--nodes", "2", "--cpus-per-node", "2",
                   "--procs-per-node", "2", "--sweep-root", str(tmp_path / "sw")], capsys)  # fmt: skip
    assert "#SBATCH --array=0,6" in out and "#SBATCH --cpus-per-task=2" in out
    assert "export DS_ACCELERATOR=cpu" in out
    assert (
        f"# run dir [0] none: {tmp_path}/sw/none" in out and f"# run dir [6] rope: {tmp_path}/sw/rope" in out
    )
    assert f"--sweep positions --sweep-root {tmp_path}/sw" in out
    assert f"--output={tmp_path}/sw/slurm-%A_%a.out" in out
    out = dry_run(["--script", "eval", "--last", "3", f"train.run_dir={tmp_path}/r"], capsys)
    assert f"tpe-ckpt average {tmp_path}/r --last 3 --out {tmp_path}/r/averaged-last3" in out
    assert f"tpe-eval --checkpoint {tmp_path}/r/averaged-last3 --json" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "nosuch"], "preset 'nosuch' not found"),
        (["--nodes", "0"], "--nodes must be at least 1"),
        (["--nodes", "two"], "argument --nodes: invalid int value: 'two'"),
        (["--script", "sweep"], "argument --script: invalid choice: 'sweep'"),
        (["--gpus-per-node", "-1"], "--gpus-per-node must be 0"),
        (["--layout", "gpu_zero9"], "layout 'gpu_zero9' not found"),
        (["--gpus-per-node", "8", "--layout", "cpu_ddp"], "runs on CPUs"),
        (["model.n_heads=5"], "not divisible by model.n_heads"),
        (["--array", "0-1"], "--array applies to --script sweep_positions"),
        (["--script", "sweep_positions", "--array", "3-19"], "index 13, outside the position sweep"),
        (["--script", "sweep_positions", "model.position.kind=t5"], "sets model.position.kind itself"),
        (["--time", "4", "--signal-before", "300"], "not shorter than --time"),
        (["--script", "eval", "--nodes", "2"], "evaluation runs on one node"),
    ],
)
def test_bad_input_is_one_paragraph_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["submit", *argv, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("tpe-launch submit: error: ")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_console_script_exit_code_and_no_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "submit", "--preset", "nosuch", "--nodes", "2"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "preset 'nosuch' not found" in proc.stderr and proc.stdout == ""
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "launch"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown command 'launch'" in proc.stderr


def test_run_dry_run_from_a_fake_allocation(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env = slurm_env(SLURM_JOB_NODELIST="node[3-4]", SLURM_NODEID="1", SLURM_NNODES="2",
                    SLURM_STEP_NUM_TASKS="2", SLURM_ARRAY_TASK_ID="4", SLURM_CPUS_ON_NODE="2")  # fmt: skip
    monkeypatch.delenv("SLURM_CONF", raising=False)  # scontrol expands the list, or fails and we read it
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)  # the dry run prints what it adds to the environment
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    argv = ["run", "--sweep", "positions", "--sweep-root", "/runs/sw", "--dry-run", "train.max_steps=4"]
    assert main(argv) == 0
    cmd = shlex.split(capsys.readouterr().out.splitlines()[-1])
    assert "DS_ACCELERATOR=cpu" in cmd
    assert flag(cmd, "--machine_rank") == "1" and flag(cmd, "--main_process_ip") == "node3"
    assert flag(cmd, "--num_processes") == "4"  # 2 nodes x one process per CPU on the node
    assert cmd[-2:] == ["model.position.kind=t5", "train.run_dir=/runs/sw/t5"]


# -- signals and exit codes, with real processes ----------------------------------------------------

# A stand-in for accelerate: an "agent" that starts a "rank" and exits 1 when the rank fails (as
# torchrun does); the rank installs its SIGUSR1 handler after DELAY seconds, then on SIGUSR1 writes
# how many it got and exits as the trainer does (``preempted_exit``: 75 and its exit record).
FAKE_LAUNCH = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    from tpe_train.run.exits import preempted_exit
    if sys.argv[1] == "agent":
        rank = subprocess.Popen([sys.executable, __file__, "rank", *sys.argv[2:]])
        sys.exit(0 if rank.wait() == 0 else 1)
    out, delay = sys.argv[2], float(sys.argv[3])
    open(out + ".started", "w").close()
    time.sleep(delay)
    got = []
    signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
    open(out + ".ready", "w").close()
    for _ in range(200):
        if got:
            time.sleep(0.3)  # "checkpoint"; a second signal now would be counted too
            open(out, "w").write(str(len(got)))
            sys.exit(preempted_exit())
        time.sleep(0.05)
    sys.exit(0)
    """
)


#: what the launcher's main sets up before it supervises: its messages on stderr
LOGGING = "import os, sys; from launcher.cli import configure_logging; configure_logging(); "


def _start_node_run(tmp_path: Path, delay: float, **env: str) -> tuple[subprocess.Popen[str], Path]:
    script = tmp_path / "fake_launch.py"
    script.write_text(FAKE_LAUNCH)
    out = tmp_path / "rank.out"
    driver = (
        f"{LOGGING}from launcher.supervise import run_node; "
        f"sys.exit(run_node([sys.executable, {str(script)!r}, 'agent', {str(out)!r}, '{delay}'], "
        "{k: v for k, v in os.environ.items() if not k.startswith('SLURM_')}))"
    )
    proc = subprocess.Popen([sys.executable, "-c", driver], text=True, stderr=subprocess.PIPE,
                            env={**os.environ, **env})  # fmt: skip
    return proc, out


def _wait_for(path: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_node_run_forwards_usr1_and_reports_preemption(tmp_path: Path) -> None:
    proc, out = _start_node_run(tmp_path, delay=0.0)
    _wait_for(out.with_suffix(".out.ready"))
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert out.read_text() == "1"  # the agent ignored it and lived; the rank got it exactly once


def test_under_supervise_a_preempted_node_ends_0_and_says_so_in_its_record(tmp_path: Path) -> None:
    status = tmp_path / "status"
    proc, out = _start_node_run(tmp_path, delay=0.0, TPE_JOB_STATUS_DIR=str(status))
    _wait_for(out.with_suffix(".out.ready"))
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err  # not a bad exit for srun --kill-on-bad-exit
    record = json.loads((status / "node-0.json").read_text())
    assert (record["outcome"], record["preempted_ranks"], record["ranks"]) == ("preempted", 1, 1)


def test_a_rank_that_fails_after_its_checkpoint_fails_the_node(tmp_path: Path) -> None:
    status = tmp_path / "status"
    # TEST-ONLY hook: rank 0 exits 1 instead of 75 once it has checkpointed
    proc, out = _start_node_run(tmp_path, delay=0.0, TPE_JOB_STATUS_DIR=str(status), TPE_TEST_EXIT="0:0:1")
    _wait_for(out.with_suffix(".out.ready"))
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "the launch failed with exit code 1 (0 of 1 ranks" in err, err
    assert json.loads((status / "node-0.json").read_text())["outcome"] == "failed"


def test_a_signal_before_the_handler_reaches_the_rank_once_it_listens(tmp_path: Path) -> None:
    proc, out = _start_node_run(tmp_path, delay=1.5)
    _wait_for(out.with_suffix(".out.started"))  # the rank runs but ignores SIGUSR1 for now
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert out.read_text() == "1"


def test_supervisor_passes_failures_through_and_75_outside_slurm() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    driver = (
        f"{LOGGING}from launcher.supervise import supervise_job; "
        "sys.exit(supervise_job(sys.argv[1:], os.environ))"
    )
    for code in (0, 3, 75):
        proc = subprocess.run(
            [sys.executable, "-c", driver, sys.executable, "-c", f"raise SystemExit({code})"],
            env=env,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == code, proc.stderr
    assert "run the same command again to resume" in proc.stderr


# A stand-in for srun under `tpe-launch supervise`: each "node" writes its status record as
# `tpe-launch run` does, then it exits with the code given; a fake scontrol logs its arguments.
FAKE_SRUN = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from launcher.supervise import write_node_status
    *outcomes, code = sys.argv[1:]
    for node, outcome in enumerate(outcomes):
        env = {"SLURM_NODEID": str(node), "SLURMD_NODENAME": f"n{node + 1}"}
        write_node_status(Path(os.environ["TPE_JOB_STATUS_DIR"]), env, outcome, 0 if outcome == "done" else 1,
                          1 if outcome == "preempted" else 0, 1)
    sys.exit(int(code))
    """
)


@pytest.mark.integration
@pytest.mark.parametrize(
    "outcomes, srun_code, requeued, code",
    [
        (["preempted", "preempted"], 0, True, 0),  # every node checkpointed: requeue
        (["done", "done"], 0, False, 0),  # finished before the signal took effect: no requeue
        (["preempted", "failed"], 1, False, 1),  # a real failure wins over a preemption
    ],
)
def test_supervisor_requeues_from_the_node_records(
    tmp_path: Path, outcomes: list[str], srun_code: int, requeued: bool, code: int
) -> None:
    (tmp_path / "srun.py").write_text(FAKE_SRUN)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    scontrol.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(SLURM_JOB_ID="123", SLURM_NNODES="2", PATH=f"{bin_dir}:{env['PATH']}")
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "supervise", "--status-dir", str(run_dir), "--",
         sys.executable, str(tmp_path / "srun.py"), *outcomes, str(srun_code)],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == code, proc.stderr
    log = tmp_path / "scontrol.log"
    assert (log.read_text() == "requeue 123\n") if requeued else not log.exists()
    for node, outcome in enumerate(outcomes):
        assert f"node {node} (n{node + 1}): {outcome}" in proc.stderr
    if "failed" in outcomes:
        assert "node 1 (n2) failed" in proc.stderr
    assert not list((run_dir / ".tpe-launch").iterdir())  # the attempt's records are removed
