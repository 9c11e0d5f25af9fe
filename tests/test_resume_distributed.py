"""Checkpoints of real 2-process DeepSpeed runs: a rank killed mid-training and mid-save, exact resume on
the same layout (with the save in the background), resuming on another number of data-parallel ranks,
another tensor-parallel size or another ZeRO stage, and resuming from what tpe-ckpt reshard wrote.
Equality is checked on parameters (and moments) and on the ids of the training pairs each step saw."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tpe_train.ckpt.shards import read_index, read_tensor
from tpe_train.ckpt.store import entries

pytestmark = pytest.mark.integration  # every test here starts the project's commands

ROOT = Path(__file__).resolve().parents[1]
COMMON = [
    "data.synthetic.train_size=1500",
    "data.synthetic.valid_size=100",  # the validation at each run's end: its loss only
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
#: a visible difference in a few weights (seen: up to 1.4e-4, DP 2 -> TP 2, in the rows of one FFN
#: layer). The parameters move by more than 1e-3 over these steps, and a wrong moment, step count or
#: batch shows as a difference of about lr = 2e-3, four times the tolerance.
TOLERANCE = 5e-4


def command(launch: str | None, run_dir: Path, *overrides: str) -> list[str]:
    args = ["-m", "tpe_train.train", *COMMON, f"train.run_dir={run_dir}", *overrides]
    if launch is None:
        return [sys.executable, *args, "train.threads=2"]
    cfg = Path(launch) if Path(launch).is_absolute() else ROOT / "configs" / "accelerate" / launch
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg), *args]


@pytest.fixture(scope="module", autouse=True)
def one_token_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every run here reads the same corpus: the first builds its token store, the rest reuse it (by
    its fingerprint, as a user's later runs do)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TPE_DATA_CACHE", str(tmp_path_factory.mktemp("data")))
        yield


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "DS_ACCELERATOR": "cpu", **extra}


def train(launch: str | None, run_dir: Path, *overrides: str) -> str:
    proc = subprocess.run(
        command(launch, run_dir, *overrides), cwd=ROOT, env=env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return proc.stdout


def weights(run_dir: Path, step: int, moments: bool = False) -> dict:
    """A checkpoint's weights (or Adam moments), consolidated from its shards."""
    path = run_dir / "checkpoints" / f"step-{step:08d}"
    index = read_index(path)
    return {n: read_tensor(path, index, n) for n in index["tensors"] if ("/" in n) == moments}


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


def run_and_kill(run_dir: Path, rank: int, when: object, **extra: str) -> None:
    """Start the 2-process run, SIGKILL one rank as soon as ``when()`` holds, wait for the launcher."""
    tag = uuid.uuid4().hex
    cmd = command("cpu_zero2.yaml", run_dir, *CRASH)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(TPE_TEST_TAG=tag, **extra))
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
    train("cpu_zero2.yaml", reference, *CRASH)
    log = crashed / "samples" / "rank-00001.jsonl"

    def past_step_7() -> bool:
        return log.exists() and len(log.read_text().splitlines()) >= 7

    run_and_kill(crashed, rank=1, when=past_step_7)  # mid-training
    assert [e.step for e in entries(crashed / "checkpoints") if e.complete] == [3, 6]
    partial = crashed / "checkpoints" / ".tmp-step-00000009"
    run_and_kill(crashed, rank=0, when=partial.exists, TPE_FAULT_SAVE_DELAY="5")  # mid-save
    assert partial.exists() and not (crashed / "checkpoints" / "step-00000009").exists()
    out = train("cpu_zero2.yaml", crashed, *CRASH)
    assert "resumed from" in out and "step-00000006 at step 6" in out
    assert not partial.exists()  # the partial checkpoint was ignored, then cleaned
    a, b = weights(reference, 12), weights(crashed, 12)
    assert all((a[k] == b[k]).all() for k in a)  # the same parameters, bitwise
    assert global_batches(crashed) == global_batches(reference)  # every step saw the same pairs


@pytest.fixture(scope="module")
def dp2_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("dp2")
    run = tmp / "run"
    train("cpu_zero2.yaml", run, "train.max_steps=8", "train.save_every=4")
    return run


def test_resume_on_the_same_two_zero2_ranks_is_exact_with_the_save_in_the_background(
    dp2_reference: Path, tmp_path: Path
) -> None:
    """4 steps + resume + 4 steps equals the reference's 8 steps bitwise, weights and moments; this run
    saves with train.async_save (its writer agrees over its own gloo group while training goes on)."""
    run = tmp_path / "run"
    start = dp2_reference / "checkpoints" / "step-00000004"
    out = train("cpu_zero2.yaml", run, f"train.resume={start}", "train.max_steps=8",
                "train.save_every=2", "train.async_save=true")  # fmt: skip
    assert "at step 4" in out
    assert [e.step for e in entries(run / "checkpoints") if e.complete] == [6, 8]
    for moments in (False, True):
        ref, got = weights(dp2_reference, 8, moments), weights(run, 8, moments)
        assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    assert global_batches(run) == {s: ids for s, ids in global_batches(dp2_reference).items() if s > 4}


def follows_reference(reference: Path, run: Path) -> None:
    """``run`` (resumed at step 4) ends where the 2-rank reference does (``TOLERANCE``), having trained
    on the same pairs in every step: nothing lost, nothing repeated."""
    ref, got, before = weights(reference, 8), weights(run, 8), weights(reference, 4)
    assert max(float((ref[k] - before[k]).abs().max()) for k in ref) > 1e-3  # the parameters moved
    assert max(float((ref[k] - got[k]).abs().max()) for k in ref) < TOLERANCE
    assert global_batches(run) == {s: ids for s, ids in global_batches(reference).items() if s > 4}


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
    follows the 2-rank reference and the data position carries over. ZeRO-3 saves in the background."""
    run = tmp_path / "run"
    start = dp2_reference / "checkpoints" / "step-00000004"
    overrides = [f"train.resume={start}", "train.max_steps=8", f"train.accumulate={accumulate}"]
    out = train(launch, run, *overrides, f"train.async_save={launch == 'cpu_zero3.yaml'}")
    assert "at step 4" in out
    saved = json.loads((run / "checkpoints" / "step-00000008" / "manifest.json").read_text())["layout"]
    assert saved == layout
    follows_reference(dp2_reference, run)


def test_resume_under_deepspeed_without_zero(dp2_reference: Path, tmp_path: Path) -> None:
    """ZeRO-0 (DeepSpeed without ZeRO) has no fragments to write Adam's moments through: they go to
    the torch optimizer's own state. Zero moments would show as a difference of about lr."""
    launch = tmp_path / "cpu_zero0.yaml"
    text = (ROOT / "configs" / "accelerate" / "cpu_zero2.yaml").read_text()
    launch.write_text(text.replace("configs/deepspeed/zero2.json", "configs/deepspeed/zero0.json"))
    run = tmp_path / "run"
    start = dp2_reference / "checkpoints" / "step-00000004"
    train(str(launch), run, f"train.resume={start}", "train.max_steps=8")
    saved = json.loads((run / "checkpoints" / "step-00000008" / "manifest.json").read_text())["layout"]
    assert saved == {"world_size": 2, "tp_size": 1, "dp_size": 2, "zero_stage": 0}
    ref, got = weights(dp2_reference, 8), weights(run, 8)
    assert max(float((ref[k] - got[k]).abs().max()) for k in ref) < TOLERANCE
    moments, reference = weights(run, 8, moments=True), weights(dp2_reference, 8, moments=True)
    assert max(float((reference[k] - moments[k]).abs().max()) for k in reference) < TOLERANCE


def test_resume_from_one_process_on_two_ranks(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    train(None, one, "train.max_steps=8", "train.save_every=4", "train.accumulate=2")
    start = one / "checkpoints" / "step-00000004"
    train("cpu_zero2.yaml", two, f"train.resume={start}", "train.max_steps=8")
    ref, got = weights(one, 8), weights(two, 8)
    assert max(float((ref[k] - got[k]).abs().max()) for k in ref) < TOLERANCE
    assert global_batches(two) == {s: ids for s, ids in global_batches(one).items() if s > 4}


def test_a_checkpoint_resharded_for_tp2_resumes_on_one_process(dp2_reference: Path, tmp_path: Path) -> None:
    """tpe-ckpt reshard re-saves the ZeRO-2 checkpoint under the TP=2 layout (DeepSpeed's own shards
    too, when asked); a one-process run resumed from that (TP 2 -> 1) follows the reference."""
    out = tmp_path / "resharded"
    src = dp2_reference / "checkpoints" / "step-00000004"
    proc = subprocess.run(
        [sys.executable, "-m", "tpe_train.ckpt.cli", "reshard", str(src), "--config_file",
         str(ROOT / "configs/accelerate/cpu_tp2.yaml"), "--out", str(out), "--deepspeed-shards"],
        cwd=ROOT, env=env(), capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    ckpt = out / "checkpoints" / "step-00000004"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["layout"]["tp_size"] == 2
    assert {"model-00000.safetensors", "model-00001.safetensors"} <= set(manifest["files"])
    assert any(name.startswith("deepspeed/") for name in manifest["files"])  # shards of the new layout
    a, b = weights(dp2_reference, 4), weights(out, 4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    run = tmp_path / "run"
    train(None, run, f"train.resume={ckpt}", "train.max_steps=8", "train.accumulate=2")
    follows_reference(dp2_reference, run)
    shutil.rmtree(out)
