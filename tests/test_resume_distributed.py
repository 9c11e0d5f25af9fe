"""Checkpoints of real 2-process DeepSpeed runs: a rank killed mid-training and mid-save, resuming on
another number of data-parallel ranks, another tensor-parallel size or another ZeRO stage, and
tpe-ckpt reshard. Equality is checked on parameters and on the ids of the training pairs each step saw."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tpe_train.ckpt_store import entries

ROOT = Path(__file__).resolve().parents[1]
COMMON = [
    "data.synthetic.train_size=1500",
    "eval.at_end=false",
    "train.valid_bleu_size=0",
    "train.progress=false",
    "train.log_samples=true",
    "train.warmup_steps=8",  # a learning rate that moves the parameters within a few steps
    # Adam turns a gradient far below eps-free scale into a +-lr step: gradients that are rounding noise
    # (key biases, near-dead ReLU units) differ with the summation order of another layout. eps 1e-4
    # keeps them from moving; real gradients here are 1e-3 and above.
    "train.adam_eps=1e-4",
    "train.clip_norm=0",  # DeepSpeed and torch compute the clipping norm in different orders
    "model.dropout=0.0",  # another layout draws other dropout masks; the crash test turns it back on
]


#: Another layout sums in another order (threads, all-reduce); a ReLU unit at its kink turns that into
#: a visible difference in a few weights (seen: up to 1.6e-5). The parameters move by more than 1e-3
#: over these steps, and a wrong moment, step count or batch shows as a difference of about lr = 2e-3.
TOLERANCE = 1e-4


def command(launch: str | None, run_dir: Path, *overrides: str) -> list[str]:
    args = ["-m", "tpe_train.train", *COMMON, f"train.run_dir={run_dir}", *overrides]
    if launch is None:
        return [sys.executable, *args, "train.threads=2"]
    cfg = Path(launch) if Path(launch).is_absolute() else ROOT / "configs" / "accelerate" / launch
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg), *args]


def env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "DS_ACCELERATOR": "cpu", "TPE_DATA_CACHE": str(tmp_path / "data"), **extra}


def train(tmp_path: Path, launch: str | None, run_dir: Path, *overrides: str) -> str:
    proc = subprocess.run(
        command(launch, run_dir, *overrides), cwd=ROOT, env=env(tmp_path), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return proc.stdout


def weights(run_dir: Path, step: int) -> dict:
    return load_file(str(run_dir / "checkpoints" / f"step-{step:08d}" / "model.safetensors"))


def global_batches(run_dir: Path) -> dict[int, list[int]]:
    """Step -> ids of the pairs all data-parallel ranks trained on (rank order; the last record of a
    step wins: a step lost in a crash is recorded again by the run that repeats it)."""
    steps: dict[int, list[int]] = {}
    for path in sorted((run_dir / "samples").glob("rank-*.jsonl")):
        seen: dict[int, list[int]] = {}
        for line in path.read_text().splitlines():
            record = json.loads(line)
            seen[record["step"]] = record["ids"]
        for step, ids in seen.items():
            steps.setdefault(step, []).extend(ids)
    return steps


def rank_pid(tag: str, rank: int) -> int | None:
    """The pid of the trainer process of ``rank`` started with TPE_TEST_TAG=tag."""
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, PermissionError):
            continue
        mine = f"TPE_TEST_TAG={tag}".encode() in environ and f"RANK={rank}".encode() in environ
        if mine and b"tpe_train.train" in (proc / "cmdline").read_bytes():
            return int(proc.name)
    return None


CRASH = ["train.max_steps=12", "train.save_every=3", "model.dropout=0.1"]


def run_and_kill(tmp_path: Path, run_dir: Path, rank: int, when: object, **extra: str) -> None:
    """Start the 2-process run, SIGKILL one rank as soon as ``when()`` holds, wait for the launcher."""
    tag = uuid.uuid4().hex
    cmd = command("cpu_zero2.yaml", run_dir, *CRASH)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(tmp_path, TPE_TEST_TAG=tag, **extra))
    deadline = time.time() + 300
    while not when():  # type: ignore[operator]
        assert proc.poll() is None and time.time() < deadline, "the run ended before the kill"
        time.sleep(0.01)
    pid = rank_pid(tag, rank)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    assert proc.wait(timeout=120) != 0


def test_a_killed_rank_mid_training_and_mid_save_loses_and_repeats_nothing(tmp_path: Path) -> None:
    reference, crashed = tmp_path / "reference", tmp_path / "crashed"
    train(tmp_path, "cpu_zero2.yaml", reference, *CRASH)
    log = crashed / "samples" / "rank-00001.jsonl"

    def past_step_7() -> bool:
        return log.exists() and len(log.read_text().splitlines()) >= 7

    run_and_kill(tmp_path, crashed, rank=1, when=past_step_7)  # mid-training
    assert [e.step for e in entries(crashed / "checkpoints") if e.complete] == [3, 6]
    partial = crashed / "checkpoints" / ".tmp-step-00000009"
    run_and_kill(tmp_path, crashed, rank=0, when=partial.exists, TPE_FAULT_SAVE_DELAY="5")  # mid-save
    assert partial.exists() and not (crashed / "checkpoints" / "step-00000009").exists()
    out = train(tmp_path, "cpu_zero2.yaml", crashed, *CRASH)
    assert "resumed from" in out and "step-00000006 at step 6" in out
    assert not partial.exists()  # the partial checkpoint was ignored, then cleaned
    a, b = weights(reference, 12), weights(crashed, 12)
    assert all((a[k] == b[k]).all() for k in a)  # the same parameters, bitwise
    assert global_batches(crashed) == global_batches(reference)  # every step saw the same pairs


@pytest.fixture(scope="module")
def dp2_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("dp2")
    run = tmp / "run"
    train(tmp, "cpu_zero2.yaml", run, "train.max_steps=8", "train.save_every=4")
    return run


@pytest.mark.parametrize(
    ("launch", "accumulate", "layout"),
    [
        (None, 2, {"world_size": 1, "tp_size": 1, "dp_size": 1, "zero_stage": None}),
        ("cpu_tp2.yaml", 2, {"world_size": 2, "tp_size": 2, "dp_size": 1, "zero_stage": 1}),
        ("cpu_zero3.yaml", 1, {"world_size": 2, "tp_size": 1, "dp_size": 2, "zero_stage": 3}),
    ],
    ids=["dp2-to-1", "dp2-to-tp2", "zero2-to-zero3"],
)
def test_resume_on_another_layout(
    dp2_reference: Path, tmp_path: Path, launch: str | None, accumulate: int, layout: dict
) -> None:
    """Same global batch per step (accumulate 2 where one rank does the work of two): the resumed run
    follows the 2-rank reference (``TOLERANCE``) and the data position carries over."""
    run = tmp_path / "run"
    start = dp2_reference / "checkpoints" / "step-00000004"
    overrides = [f"train.resume={start}", "train.max_steps=8", f"train.accumulate={accumulate}"]
    out = train(tmp_path, launch, run, *overrides)
    assert "at step 4" in out
    saved = json.loads((run / "checkpoints" / "step-00000008" / "manifest.json").read_text())["layout"]
    assert saved == layout
    ref, got, before = weights(dp2_reference, 8), weights(run, 8), weights(dp2_reference, 4)
    assert max(float((ref[k] - before[k]).abs().max()) for k in ref) > 1e-3  # the parameters moved
    assert max(float((ref[k] - got[k]).abs().max()) for k in ref) < TOLERANCE
    expected = {s: ids for s, ids in global_batches(dp2_reference).items() if s > 4}
    assert global_batches(run) == expected  # nothing lost, nothing repeated


def test_resume_under_deepspeed_without_zero(dp2_reference: Path, tmp_path: Path) -> None:
    """ZeRO-0 (DeepSpeed without ZeRO) has no fragments to write Adam's moments through: they go to
    the torch optimizer's own state. Zero moments would show as a difference of about lr."""
    launch = tmp_path / "cpu_zero0.yaml"
    text = (ROOT / "configs" / "accelerate" / "cpu_zero2.yaml").read_text()
    launch.write_text(text.replace("configs/deepspeed/zero2.json", "configs/deepspeed/zero0.json"))
    run = tmp_path / "run"
    start = dp2_reference / "checkpoints" / "step-00000004"
    train(tmp_path, str(launch), run, f"train.resume={start}", "train.max_steps=8")
    saved = json.loads((run / "checkpoints" / "step-00000008" / "manifest.json").read_text())["layout"]
    assert saved == {"world_size": 2, "tp_size": 1, "dp_size": 2, "zero_stage": 0}
    ref, got = weights(dp2_reference, 8), weights(run, 8)
    assert max(float((ref[k] - got[k]).abs().max()) for k in ref) < TOLERANCE
    moments = load_file(str(run / "checkpoints" / "step-00000008" / "optimizer.safetensors"))
    reference = load_file(str(dp2_reference / "checkpoints" / "step-00000008" / "optimizer.safetensors"))
    assert max(float((reference[k] - moments[k]).abs().max()) for k in reference) < TOLERANCE


def test_resume_from_one_process_on_two_ranks(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    train(tmp_path, None, one, "train.max_steps=8", "train.save_every=4", "train.accumulate=2")
    start = one / "checkpoints" / "step-00000004"
    train(tmp_path, "cpu_zero2.yaml", two, f"train.resume={start}", "train.max_steps=8")
    ref, got = weights(one, 8), weights(two, 8)
    assert max(float((ref[k] - got[k]).abs().max()) for k in ref) < TOLERANCE
    assert global_batches(two) == {s: ids for s, ids in global_batches(one).items() if s > 4}


def test_tpe_ckpt_reshard(dp2_reference: Path, tmp_path: Path) -> None:
    out = tmp_path / "resharded"
    src = dp2_reference / "checkpoints" / "step-00000004"
    proc = subprocess.run(
        [sys.executable, "-m", "tpe_train.ckpt_cli", "reshard", str(src), "--config_file",
         str(ROOT / "configs/accelerate/cpu_tp2.yaml"), "--out", str(out)],
        cwd=ROOT, env=env(tmp_path), capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    ckpt = out / "checkpoints" / "step-00000004"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["layout"]["tp_size"] == 2
    assert any(name.startswith("deepspeed/") for name in manifest["files"])  # shards of the new layout
    a, b = load_file(str(src / "model.safetensors")), load_file(str(ckpt / "model.safetensors"))
    assert all((a[k] == b[k]).all() for k in a)
    shutil.rmtree(out)
