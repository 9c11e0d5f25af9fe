"""Distributed training with real engines: ``accelerate launch`` of 2 CPU processes over gloo, DeepSpeed
ZeRO 1-3 and AutoTP. Each test launches real processes (about 10 s each) and asserts on what they wrote."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tpe_train.positions import POSITIONS

pytestmark = pytest.mark.integration  # every test here starts the project's commands

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "support" / "dist_harness.py"


def launch(
    config_file: Path, args: list[str], tmp_path: Path, timeout: int = 600
) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "TPE_DATA_CACHE": str(tmp_path / "data"),
    }
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def zero_launch_file(tmp_path: Path, stage: int, offload: bool = False, tp: int = 1) -> Path:
    """A 2-process CPU launch file whose DeepSpeed file asks for ZeRO ``stage`` (optionally with
    optimizer and parameter offload, or tensor parallelism); every parameter is partitioned under
    ZeRO-3 (no persistence threshold), so the test covers the gathering paths."""
    zero: dict = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload:
        zero |= {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    ds = tmp_path / f"zero{stage}.json"
    ds.write_text(json.dumps({"zero_optimization": zero, "tensor_parallel": {"autotp_size": tp}}))
    text = (ROOT / "configs/accelerate/cpu_zero2.yaml").read_text()
    out = tmp_path / f"zero{stage}.yaml"
    out.write_text(text.replace("configs/deepspeed/zero2.json", str(ds)))
    return out


#: Linear layers of the harness's 2 + 2-layer model: 6 per encoder layer, 10 per decoder layer, output.
LINEARS = 2 * 6 + 2 * 10 + 1
# q|k|v and cross-attention's k|v as one product each (kernels.linears; not under ZeRO-3)
FUSED_LINEARS = 2 * 4 + 2 * 7 + 1


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def test_tensor_parallel_2_equals_1_for_every_encoding(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    kinds = POSITIONS.names()
    launch(ROOT / "configs/accelerate/cpu_tp2.yaml", [str(HARNESS), "tp", str(out), *kinds], tmp_path)
    result = json.loads(out.read_text())
    assert sorted(result) == sorted([*kinds, "sinusoidal+dropout", "sinusoidal+onednn"])
    for kind, r in result.items():
        assert r["tp_size"] == 2
        assert r["logit_widths"] == [32], r["logit_widths"]  # each rank scores 32 of the harness's 64 words
        assert relative(r["loss"], r["ref_loss"]) < 1e-5, (kind, r)
        assert relative(r["grad_norm"], r["ref_grad_norm"]) < 1e-5, (kind, r)
        assert r["param_diff"] < 1e-5, (kind, r["worst"])  # after the optimizer step, shards gathered
    # With dropout the loss differs from the dropout-free run, yet TP=2 still equals one process:
    # the dropout masks on replicated activations agree across the tensor-parallel ranks.
    assert relative(result["sinusoidal+dropout"]["loss"], result["sinusoidal"]["loss"]) > 1e-3
    # train.cpu_gemm=onednn: the training GEMMs through oneDNN (the output layer's on the sharded side,
    # whose projections are AutoTP's own modules; every linear layer in the single process) change
    # nothing beyond rounding.
    onednn = result["sinusoidal+onednn"]
    assert (onednn["onednn_nodes"], onednn["ref_onednn_nodes"]) == (1, FUSED_LINEARS)
    assert result["sinusoidal"]["onednn_nodes"] == result["sinusoidal"]["ref_onednn_nodes"] == 0  # auto
    # Each rank holds only its heads' T5 columns and half the learned table's rows ...
    assert result["t5"]["position_params"]["encoder.positions.0.table.weight"] == [8, 2]
    assert result["learned"]["position_params"]["encoder.positions.0.table.weight"] == [32, 32]
    # ... and Shaw's small per-layer tables stay whole (replicated, gradients summed over the group).
    assert result["shaw"]["position_params"]["encoder.positions.0.keys"] == [7, 8]
    # Position-table bytes per rank: at most 0.55x of one process for T5, ALiBi and learned.
    for kind in ("t5", "alibi", "learned"):
        mem, ref = result[kind]["memory"], result[kind]["ref_memory"]
        assert 0 < mem["positions"] <= 0.55 * ref["positions"], (kind, mem, ref)


def test_tensor_parallel_with_zero3(tmp_path: Path) -> None:
    """AutoTP with ZeRO-3 (which DeepSpeed accepts): still exact, position shards included."""
    out = tmp_path / "tp.json"
    launch(zero_launch_file(tmp_path, 3, tp=2), [str(HARNESS), "tp", str(out), "t5", "learned"], tmp_path)
    result = json.loads(out.read_text())
    assert result["sinusoidal+onednn"]["onednn_nodes"] == 1  # the output layer, its weight gathered
    for kind, r in result.items():
        assert relative(r["loss"], r["ref_loss"]) < 1e-5, (kind, r)
        assert relative(r["grad_norm"], r["ref_grad_norm"]) < 1e-5, (kind, r)
        assert r["param_diff"] < 1e-5, (kind, r["worst"])


def test_tensor_parallel_forward_with_flex_equals_one_process(tmp_path: Path) -> None:
    """TP=2 with model.attention=flex (forward only: no CPU backward) against one explicit process:
    head-sliced T5 tables and ALiBi slopes enter flex's score_mod with the rank's global heads."""
    out = tmp_path / "tp-flex.json"
    kinds = POSITIONS.names()
    launch(ROOT / "configs/accelerate/cpu_tp2.yaml", [str(HARNESS), "tp-flex", str(out), *kinds], tmp_path)
    result = json.loads(out.read_text())
    assert sorted(result) == sorted(kinds)
    for kind, r in result.items():
        assert r["tp_size"] == 2
        assert relative(r["nll"], r["ref_nll"]) < 1e-5, (kind, r)


def test_plain_ddp_with_two_ranks_follows_one_process(tmp_path: Path) -> None:
    """`accelerate launch` of configs/accelerate/cpu_ddp.yaml (no DeepSpeed): the gradients are averaged
    over the ranks (torch DDP), so 2 ranks with half a batch each follow one process with the whole.
    The first step searches for parameters without gradients; with none, the later steps do not."""
    out = tmp_path / "ddp.json"
    launch(ROOT / "configs/accelerate/cpu_ddp.yaml", [str(HARNESS), "zero", str(out), "4"], tmp_path)
    result = json.loads(out.read_text())
    assert result["dp_size"] == 2 and result["zero_stage"] is None
    assert [step["find_unused"] for step in result["steps"]] == [1.0, 0.0, 0.0, 0.0]
    for step in result["steps"]:
        assert relative(step["loss"], step["ref_loss"]) < 1e-6, step
        assert relative(step["grad_norm"], step["ref_grad_norm"]) < 1e-6, step
        assert step["param_diff"] < 1e-6, step
    assert result["steps"][-1]["moved"] > 40 * 1e-6  # the parameters move, so the comparison can fail


def test_fp16_ddp_with_two_ranks_follows_one_process(tmp_path: Path) -> None:
    """train.fp16 without DeepSpeed under DDP: torch's loss scaling on 2 ranks follows one process with
    the whole batch over 10 steps, through the skipped updates of a first scale that overflows and of
    the scale's growth every 2 steps: the same steps are skipped (an overflow on one rank reaches the
    other in the averaged gradient), the scale ends the same, the losses agree within 1e-4 and the
    gradient norms of the updates within 1e-2 (relative). Parameters are not compared element by
    element: Adam's first updates move every element by about lr whatever its gradient's size, and
    elements whose gradient is at fp16's rounding noise (a power-of-2 scale apart between the two:
    one process divides by its 2 accumulated batches before the backward) move in opposite
    directions (measured: 1.5e-4 apart after the first update, lr 1e-4)."""
    out = tmp_path / "ddp.json"
    launch(ROOT / "configs/accelerate/cpu_ddp.yaml", [str(HARNESS), "zero", str(out), "10", "fp16"], tmp_path)
    result = json.loads(out.read_text())
    assert result["dp_size"] == 2 and result["zero_stage"] is None
    steps = result["steps"]
    skipped = [not math.isfinite(step["grad_norm"]) for step in steps]
    assert skipped == [not math.isfinite(step["ref_grad_norm"]) for step in steps]
    assert skipped[0] and not all(skipped), steps  # an overflow first, then updates
    for step, skip in zip(steps, skipped, strict=True):
        assert relative(step["loss"], step["ref_loss"]) < 1e-4, step
        assert skip or relative(step["grad_norm"], step["ref_grad_norm"]) < 1e-2, step
    assert result["loss_scale"] == result["ref_loss_scale"]
    assert steps[-1]["moved"] > 0 and steps[0]["moved"] == 0  # a skipped first step moves nothing


@pytest.mark.parametrize("launch_file", ["ddp", "zero1", "zero2"])
def test_compiled_layers_under_ddp_and_zero_follow_one_eager_process(
    tmp_path: Path, launch_file: str
) -> None:
    """train.compile under DDP and DeepSpeed ZeRO-1/2: 2 ranks with compiled layers (inductor) follow
    one eager process with the same global batch for 3 steps (new batch shapes every step)."""
    if launch_file == "ddp":
        config_file = ROOT / "configs/accelerate/cpu_ddp.yaml"
    else:
        config_file = zero_launch_file(tmp_path, int(launch_file[-1]))
    out = tmp_path / "zero.json"
    launch(config_file, [str(HARNESS), "zero", str(out), "3", "compile"], tmp_path)
    result = json.loads(out.read_text())
    assert result["compiled"] and result["dp_size"] == 2
    assert result["zero_stage"] == (None if launch_file == "ddp" else int(launch_file[-1]))
    # Compiled and eager kernels round differently, and Adam turns the rounding noise of gradients
    # that are zero in exact arithmetic (key biases) into +-lr steps: compare losses and gradient
    # norms (within the 1e-4 of the compiled-step goal), not parameters.
    for step in result["steps"]:
        assert relative(step["loss"], step["ref_loss"]) < 1e-4, step
        assert relative(step["grad_norm"], step["ref_grad_norm"]) < 1e-4, step
    assert result["steps"][0]["loss"] != result["steps"][-1]["loss"]


@pytest.mark.parametrize(
    ("stage", "offload", "cpu_gemm"),
    [(0, False, "auto"), (1, False, "auto"), (2, False, "auto"), (3, False, "onednn"), (3, True, "auto")],
)
def test_zero_with_two_ranks_follows_one_process(
    tmp_path: Path, stage: int, offload: bool, cpu_gemm: str
) -> None:
    """ZeRO-3 runs its linear layers through oneDNN (train.cpu_gemm=onednn) on the gathered weights."""
    out = tmp_path / "zero.json"
    args = [str(HARNESS), "zero", str(out), "5", cpu_gemm]
    launch(zero_launch_file(tmp_path, stage, offload), args, tmp_path)
    result = json.loads(out.read_text())
    assert (result["zero_stage"], result["dp_size"]) == (stage, 2)
    assert result["onednn_nodes"] == (LINEARS if cpu_gemm == "onednn" else 0)
    assert result["memory"]["offloaded"] is offload
    # The parameters really move (about lr = 1e-4 a step), so the comparison can fail.
    assert result["steps"][-1]["moved"] > 40 * 1e-5
    for step in result["steps"]:
        assert step["param_diff"] < 1e-5, step
        assert relative(step["loss"], step["ref_loss"]) < 1e-5, step
        assert relative(step["grad_norm"], step["ref_grad_norm"]) < 1e-5, step
    mem, ref = result["memory"], result["ref_memory"]
    if stage >= 1:  # Adam's moments: a half each
        assert mem["optimizer_state_held"] <= 0.55 * ref["optimizer_state_held"]
    if (
        stage == 3 and not offload
    ):  # parameters too, and no duplicate fp32 master (offload keeps one in host memory)
        assert mem["parameters"] + mem["optimizer"] <= 0.55 * (ref["parameters"] + ref["optimizer"]), (
            mem,
            ref,
        )
    if stage >= 2:
        assert mem["gradients"] <= 0.55 * ref["gradients"]


def scalars(run_dir: Path) -> dict[str, list[Any]]:
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_accelerate_launch_of_the_demo_with_zero2(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [
        "-m",
        "tpe_train.train",
        "--preset",
        "demo",
        "train.max_steps=8",
        "train.log_every=2",
        "train.valid_every=4",
        "train.valid_bleu_size=20",
        "train.progress=false",
        "data.synthetic.train_size=1500",
        "data.synthetic.test_size=60",
        "data.synthetic.probe_size=20",
        "data.synthetic.long_size=20",
        "data.synthetic.valid_size=100",
        f"train.run_dir={run_dir}",
    ]
    proc = launch(ROOT / "configs/accelerate/cpu_zero2.yaml", args, tmp_path)
    assert proc.stdout.count("tpe-train: demo |") == 1  # only rank 0 prints
    assert "world 2 = data-parallel 2 x tensor-parallel 1" in proc.stdout
    # the demo's threads: 2 in each rank: capped where 2 ranks x 2 threads would share fewer cores
    capped = (proc.stdout + proc.stderr).count("train.threads=2 in each of 2 processes on this node")
    assert capped == (len(os.sched_getaffinity(0)) < 4), proc.stdout[-2000:] + proc.stderr[-2000:]  # once
    assert (run_dir / "checkpoint" / "model.safetensors").exists()
    ds = json.loads((run_dir / "deepspeed.json").read_text())
    assert ds["zero_optimization"]["stage"] == 2 and "optimizer" not in ds
    memory = json.loads((run_dir / "memory.json").read_text())
    assert [m["rank"] for m in memory] == [0, 1]
    tags = scalars(run_dir)
    assert [s for s, _ in tags["train/loss"]] == [2, 4, 6, 8]
    assert {"valid/nll", "valid/bleu", "test/bleu", "train/tokens_per_s"} <= set(tags)
    evaluated = json.loads((run_dir / "eval.json").read_text())
    assert 0.0 <= evaluated["bleu"] <= 100.0
    # The export is a plain single-device checkpoint that tpe-eval reads.
    check = subprocess.run(
        [
            sys.executable,
            "-m",
            "tpe_train.evaluation",
            "--checkpoint",
            str(run_dir / "checkpoint"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TPE_DATA_CACHE": str(tmp_path / "data")},
    )
    assert check.returncode == 0, check.stderr[-3000:]
    assert abs(json.loads(check.stdout)["bleu"] - evaluated["bleu"]) < 1e-6


def test_bf16_with_tensor_parallelism_trains(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [
        "-m",
        "tpe_train.train",
        "model.position.kind=t5",
        "train.bf16=true",
        "model.d_model=64",  # bf16 matrix products are slow on CPUs without bf16 instructions
        "model.ffn_dim=256",
        "train.max_steps=20",  # the loss falls by about 1.5 in these steps (asserted: 0.5)
        "train.warmup_steps=10",
        "train.log_every=5",
        "train.valid_every=20",
        "train.valid_bleu_size=0",
        "train.progress=false",
        "eval.at_end=false",
        "data.synthetic.train_size=1500",
        f"train.run_dir={run_dir}",
    ]
    proc = launch(ROOT / "configs/accelerate/cpu_tp2.yaml", args, tmp_path)
    assert "data-parallel 1 x tensor-parallel 2" in proc.stdout
    assert json.loads((run_dir / "deepspeed.json").read_text())["bf16"] == {"enabled": True}
    losses = [v for _, v in scalars(run_dir)["train/loss"]]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5, losses
    memory = json.loads((run_dir / "memory.json").read_text())
    # bf16 weights: 2 bytes a parameter, a fp32 master copy in the optimizer
    assert memory[0]["optimizer"] == 3 * 2 * memory[0]["parameters"]


def test_four_processes_tensor_parallel_2_x_data_parallel_2(tmp_path: Path) -> None:
    """The 2-D layout on 4 processes: AutoTP pairs (0, 1) and (2, 3), each pair one data-parallel rank
    with its own half of the global batch; 3 steps follow one process holding the whole batch."""
    launch_file = tmp_path / "tp2_dp2.yaml"
    text = (ROOT / "configs/accelerate/cpu_tp2.yaml").read_text()
    launch_file.write_text(text.replace("num_processes: 2", "num_processes: 4"))
    out = tmp_path / "zero.json"
    launch(launch_file, [str(HARNESS), "zero", str(out), "3"], tmp_path)
    result = json.loads(out.read_text())
    assert (result["dp_size"], result["zero_stage"]) == (2, 1)
    for step in result["steps"]:
        assert step["param_diff"] < 1e-5, step
        assert relative(step["loss"], step["ref_loss"]) < 1e-5, step
        assert relative(step["grad_norm"], step["ref_grad_norm"]) < 1e-5, step
    assert result["steps"][-1]["moved"] > 20 * 1e-5
