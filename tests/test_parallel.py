"""Parallel layout in one process: ParallelContext, the DeepSpeed config we generate, refused layouts,
and the tensor-parallel slicing of the head-wise position tables."""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset
from support.models import tiny_model

from tpe_train.config import ConfigError, load_config
from tpe_train.data.batching import collate
from tpe_train.parallel.context import ParallelContext, local_device
from tpe_train.parallel.deepspeed import deepspeed_config, resolve_layout
from tpe_train.parallel.plan import PARTITION, position_bytes, shard_positions
from tpe_train.positions import PositionEncoding


def launch_env(
    monkeypatch: pytest.MonkeyPatch, template: dict | None, tmp_path: Path, world: int = 2
) -> None:
    """The environment ``accelerate launch`` gives a process of a DeepSpeed launch file."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    if template is None:
        monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
        return
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(template))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))


@pytest.mark.parametrize(
    ("env", "gpus", "local_rank", "expected"),
    [
        ({}, 0, 0, "cpu"),  # torch sees no GPU
        ({}, 2, 1, "cuda:1"),  # one GPU per local rank
        ({}, 2, 3, "cuda:1"),  # more local ranks than GPUs share them round-robin
        ({"ACCELERATE_USE_CPU": "True"}, 2, 0, "cpu"),  # a CPU launch file on a GPU machine
        ({"DS_ACCELERATOR": "cpu"}, 2, 0, "cpu"),
    ],
)
def test_each_rank_takes_its_gpu_unless_the_launch_asks_for_the_cpu(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], gpus: int, local_rank: int, expected: str
) -> None:
    # This machine has no GPU: torch's answers are set, the choice is ours.
    for name in ("ACCELERATE_USE_CPU", "DS_ACCELERATOR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert str(local_device(local_rank)) == expected


def test_one_process_context_is_on_the_cpu_here_and_batches_follow_it() -> None:
    ctx = ParallelContext.from_env()
    assert ctx.device == torch.device("cpu") and "on cpu" in ctx.describe()
    rows = {"id": [0, 1], "src_ids": [[5, 6, 7], [5]], "tgt_ids": [[8, 9, 2], [8, 9, 10, 2]]}
    batch = collate(Dataset.from_dict(rows), np.arange(2))
    assert batch.to(ctx.device) is batch  # already there: no copy
    meta = batch.to(torch.device("meta"))  # another device: every tensor moves, the ids stay
    assert {t.device.type for t in (meta.src, meta.tgt_in, meta.tgt_out)} == {"meta"}
    assert meta.src.shape == batch.src.shape and meta.ids is batch.ids


def test_context_grid() -> None:
    ranks = [ParallelContext.fake(world_size=8, rank=r, tp_size=2) for r in range(8)]
    assert [(c.dp_rank, c.tp_rank) for c in ranks[:4]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(c.dp_size == 4 for c in ranks)
    assert ranks[1].heads(8) == [4, 5, 6, 7] and ranks[2].heads(8) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="not a multiple of the tensor-parallel size"):
        ParallelContext.fake(world_size=3, tp_size=2)


def test_generated_deepspeed_config_takes_layout_from_file_and_training_from_ours(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    template = {
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "gradient_clipping": "auto",
        "tensor_parallel": {"autotp_size": 2},
    }
    launch_env(monkeypatch, template, tmp_path, world=4)
    cfg = load_config("demo", ["train.accumulate=3", "train.clip_norm=0.5", "train.bf16=true"])
    layout = resolve_layout(cfg)
    assert (layout.tp_size, layout.zero_stage, layout.world_size) == (2, 3, 4)
    ds = deepspeed_config(cfg, layout)
    assert ds["zero_optimization"] == template["zero_optimization"]
    assert ds["gradient_accumulation_steps"] == 3 and ds["gradient_clipping"] == 0.5
    assert ds["bf16"] == {"enabled": True} and ds["fp16"]["enabled"] is False
    assert ds["tensor_parallel"] == {"autotp_size": 2, "partition_config": PARTITION}
    assert "optimizer" not in ds and "scheduler" not in ds


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam"}}, "'optimizer', which tpe-train"),
        ({"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0}, "train.clip_norm"),
        ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}, "train.bf16"),
        ({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}, "train.accumulate"),
    ],
)
def test_a_setting_with_two_owners_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, template: dict, message: str
) -> None:
    launch_env(monkeypatch, template, tmp_path)
    with pytest.raises(ConfigError, match=message):
        resolve_layout(load_config("demo", []))


@pytest.mark.parametrize(
    ("overrides", "template", "world", "message"),
    [
        (
            ["model.n_heads=4", "parallel.tp_size=3"],
            {"zero_optimization": {"stage": 1}},
            3,
            "n_heads \\(4\\)",
        ),
        (
            ["model.ffn_dim=510", "parallel.tp_size=4"],
            {"zero_optimization": {"stage": 1}},
            4,
            "ffn_dim \\(510\\)",
        ),
        (
            ["model.position.kind=learned", "model.position.max_positions=257", "parallel.tp_size=2"],
            {"zero_optimization": {"stage": 1}},
            2,
            "max_positions \\(257\\)",
        ),
        (["parallel.tp_size=2"], None, 2, "runs through DeepSpeed AutoTP"),
        (["parallel.tp_size=2"], {"zero_optimization": {"stage": 1}}, 3, "not a multiple"),
        (
            ["parallel.tp_size=4"],
            {"zero_optimization": {}, "tensor_parallel": {"autotp_size": 2}},
            4,
            "set one",
        ),
        (
            ["train.fp16=true"],
            {"zero_optimization": {"stage": 2}},
            2,
            "train.fp16 under DeepSpeed needs GPUs",
        ),
        (["model.attention=flex"], None, 1, "model.attention=flex cannot train on the CPU"),
        (["train.compile=true"], {"zero_optimization": {"stage": 3}}, 2, "train.compile=true .* ZeRO-3"),
        (
            ["train.compile=true"],
            {"zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2}},
            2,
            r"train.compile=true .* tensor parallelism \(size 2\)",
        ),
    ],
)
def test_impossible_layouts_are_refused(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    overrides: list[str],
    template: dict | None,
    world: int,
    message: str,
) -> None:
    launch_env(monkeypatch, template, tmp_path, world)
    with pytest.raises(ConfigError, match=message):
        resolve_layout(load_config("demo", overrides))


@pytest.mark.integration
def test_impossible_layout_stops_the_trainer_before_any_work(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "tpe_train.train", "parallel.tp_size=2", f"train.run_dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "impossible parallel layout" in proc.stderr and "Traceback" not in proc.stderr
    assert not run_dir.exists()  # nothing written


@pytest.mark.parametrize("kind", ["t5", "alibi", "kerple_log", "kerple_power", "sandwich", "fire"])
def test_head_tables_are_sliced_by_rank(kind: str) -> None:
    """Each of two TP ranks stores half the table and builds the rows of its own global heads (FIRE:
    half of its output layer; its hidden layer, c and L whole on each rank, their gradient summed)."""
    full = tiny_model(kind)
    with torch.no_grad():  # trained-looking parameters: no two heads alike
        for param in full.encoder.pos(0).parameters():
            param.add_(torch.randn_like(param) * 0.1)
    q, pos = torch.randn(1, 4, 5, 8), torch.arange(5)
    expected = full.encoder.pos(0).attn_bias(q, pos, pos)
    parts = []
    for rank in range(2):
        model = copy.deepcopy(full)
        shard_positions(model, ParallelContext.fake(world_size=2, rank=rank, tp_size=2))
        enc = model.encoder.pos(0)
        parts.append(enc.attn_bias(q[:, enc.heads], pos, pos))
        if kind != "fire":
            assert position_bytes(model) == position_bytes(full) // 2
            continue
        for stack in (model.encoder, model.decoder):
            fire = stack.pos(0)
            rows = [p for n, p in fire.named_parameters() if n in fire.head_dims()]
            shared = [p for n, p in fire.named_parameters() if n not in fire.head_dims()]
            assert rows and all(p.shape[0] == 2 and p.tp_dim == 0 for p in rows)  # type: ignore[attr-defined]
            assert shared and all(p._backward_hooks for p in shared)  # summed over the group
    assert expected is not None
    torch.testing.assert_close(torch.cat(parts, dim=1), expected)  # type: ignore[arg-type]


def test_every_encoding_declares_how_tensor_parallelism_treats_it() -> None:
    from tpe_train.positions import POSITIONS

    for name in POSITIONS.names():
        assert POSITIONS.get(name).tp_split in ("heads", "positions", "replicated"), name
    assert issubclass(POSITIONS.get("t5"), PositionEncoding)


RANK_EXIT = """
import atexit, os
import torch.distributed as dist
from tpe_train.parallel.context import ParallelContext
# registered first, so it runs last (atexit is LIFO): after whatever from_env registered
def report():
    line = f"rank {os.environ['RANK']} group alive at exit: {dist.is_initialized()}\\n"
    os.write(1, line.encode())  # one write: the two ranks share the pipe
atexit.register(report)
ctx = ParallelContext.from_env()
t = __import__("torch").ones(1)
dist.all_reduce(t)
assert t.item() == ctx.world_size
"""


def test_a_launched_rank_destroys_its_process_group_before_the_interpreter_ends(tmp_path: Path) -> None:
    """gloo threads alive at interpreter finalization can abort the process (SIGABRT, seen once on a
    rank of the 4-process test): every rank that joined a group leaves it at exit. Real torchrun,
    2 gloo processes."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_EXIT)
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(port), str(script)]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = sorted(line for line in proc.stdout.splitlines() if "group alive at exit" in line)
    assert lines == [f"rank {r} group alive at exit: False" for r in (0, 1)], proc.stdout[-2000:]


END_PROCESS = """
import atexit, os, sys
import torch.distributed as dist
from tpe_train.run.exits import end_process
class Finalized:
    def __del__(self, write=os.write):  # runs only in interpreter finalization (module globals gone)
        write(1, b"finalized\\n")
keep = Finalized()
# registered first, so it runs last (atexit is LIFO), after the group's own handler
atexit.register(lambda: os.write(1, f"exit handler: group alive {dist.is_initialized()}\\n".encode()))
if sys.argv[1] == "group":
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    atexit.register(dist.destroy_process_group)  # as ParallelContext.from_env does
print("buffered output", end="")  # a pipe: block-buffered, lost unless flushed
end_process(3)
"""


@pytest.mark.parametrize("joined", [True, False])
def test_a_rank_that_joined_a_group_ends_without_interpreter_finalization(
    tmp_path: Path, joined: bool
) -> None:
    """tpe-train's exit (``end_process``): with a process group, the exit handlers run (the group is
    destroyed before the last one), the output is flushed, and finalization, where gloo's threads can
    abort a finished rank, never happens; without one, a normal exit. The status is kept both ways."""
    script = tmp_path / "end.py"
    script.write_text(END_PROCESS)
    proc = subprocess.run(
        [sys.executable, str(script), "group" if joined else "alone"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    out = proc.stdout
    assert "buffered output" in out and "exit handler: group alive False" in out, out
    assert ("finalized" in out) is not joined, out
