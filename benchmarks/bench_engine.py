"""What DeepSpeed costs a training step, and how much of that is this project's code: the trainer's step
through the plain engine and through DeepSpeed ZeRO 0, 1 and 2, side by side in one process.

Run from the repository root::

    python benchmarks/bench_engine.py                                  # demo model, CPU
    python benchmarks/bench_engine.py --device cuda --bf16             # one GPU
    python benchmarks/bench_engine.py --preset wmt14_en_de_big --batch 96 --length 64 --device cuda --bf16
    python benchmarks/bench_engine.py --batch 4 --length 8 --deepspeed-adamw default  # overhead only
    python benchmarks/bench_engine.py --smoke                          # small mode, seconds

Every row runs ``tpe_train.train.step.train_step`` (the trainer's step: token count, loss scale, forward,
backward, clipping at 1.0, the trainer's fused AdamW (over DeepSpeed's flat partitions in the DeepSpeed
rows; ``--deepspeed-adamw default``: torch's default there instead), schedule) on the same model
(``--preset``, same seed) and batches (``--batch`` sentences of up to ``--length`` source and target
tokens, 4 batches taken in turn):

- ``plain``: ``tpe_train.parallel.engine.Engine`` without a wrapper, as one ``tpe-train`` process trains;
- ``ZeRO-k``: the same ``Engine`` with DeepSpeed stage k (``configs/deepspeed/zero{k}.json`` through
  ``deepspeed_config``, prepared by accelerate), one process (world size 1), as ``tpe-launch run
  --layout gpu_zero1`` trains on one GPU (its default there, ``gpu_single``, is the plain row). With
  ``--bf16`` DeepSpeed keeps bf16 weights and the plain row runs under bf16 autocast, as the trainer
  does.

Time: ``--warmup`` untimed steps per row, then ``--steps`` rounds of one timed step per row, the order
rotated each round (``harness.interleave``: CUDA events on a GPU); median and 90th percentile, and
each row's median over the plain row's.

Where the host's time goes: ``--profile-steps`` more steps per row under ``cProfile``; every function's
own time (not its callees') summed by the package of its source file: ``deepspeed``, ``accelerate``,
``tpe_train`` (this project), ``torch`` (its Python), and ``C`` (functions implemented in C: torch's
ops, waits for the GPU, builtins). Per step, in ms. The profiler slows Python calls, so these add up
to more than the timed step; compare them across rows, not with the step time.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import socket
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from harness import (
    SMOKE_MODEL,
    FnRow,
    Uniform,
    build,
    environment,
    interleave,
    p90,
    parse_with_smoke,
    sync,
    write_json,
)

from tpe_train.config import Config, load_config
from tpe_train.data.batching import Batch
from tpe_train.parallel.context import ParallelContext
from tpe_train.parallel.engine import Engine
from tpe_train.train.build import build_engine, build_optimizer
from tpe_train.train.step import train_step

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("deepspeed", "accelerate", "tpe_train", "torch", "C", "other")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="demo", help="the model's preset")
    parser.add_argument("--batch", type=int, default=32, help="sentences per batch")
    parser.add_argument("--length", type=int, default=16, help="longest source and target sentence")
    parser.add_argument("--stages", default="0,1,2", help="ZeRO stages of the DeepSpeed rows")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--bf16", action="store_true", help="bf16, as train.bf16")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per row")
    parser.add_argument("--steps", type=int, default=50, help="timed rounds")
    parser.add_argument("--profile-steps", type=int, default=50, help="steps per row under cProfile")
    parser.add_argument(
        "--deepspeed-adamw",
        choices=["fused", "default"],
        default="fused",
        help="the DeepSpeed rows' AdamW: fused (the trainer's) or torch's default (fused=False: foreach on "
        "a GPU, one tensor at a time on a CPU; what the trainer gave DeepSpeed before)",
    )
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    small = {"batch": 4, "length": 8, "warmup": 1, "steps": 2, "profile_steps": 2}
    return parse_with_smoke(parser, argv, small)


def launch_environment(device: str) -> None:
    """One process as a launcher would start it (DeepSpeed initialises a world of one); DeepSpeed's
    CPU accelerator on a CPU. Before DeepSpeed is imported."""
    with socket.socket() as s:  # a free port for the world of one
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    defaults = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": "0", "WORLD_SIZE": "1"}
    for key, value in {**defaults, "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(key, value)
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


class DeepSpeedLayout:
    """What ``deepspeed_config`` reads of a launch layout: the DeepSpeed file, no tensor parallelism."""

    tp_size = 1

    def __init__(self, stage: int) -> None:
        import json

        self.deepspeed = json.loads((ROOT / "configs" / "deepspeed" / f"zero{stage}.json").read_text())


def engine(cfg: Config, ctx: ParallelContext, stage: int | None, fused: bool = True) -> Engine:
    """The trainer's engine over a fresh model (same seed every row); ``stage`` None: plain torch;
    ``fused``: the DeepSpeed rows' AdamW (the plain row's is always fused)."""
    from tpe_train.parallel.deepspeed import deepspeed_config

    model = build(cfg, device=ctx.device).train()
    ds = None
    if stage is not None:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=False)  # one accelerator per DeepSpeed row
        ds = deepspeed_config(cfg, DeepSpeedLayout(stage))  # type: ignore[arg-type]
    return build_engine(model, cfg, ctx, ds, build_optimizer(model, cfg.train, fused=fused or ds is None))


def package(filename: str) -> str:
    if filename == "~" or filename.startswith("<built-in"):
        return "C"
    path = filename.replace(os.sep, "/")
    for name in ("deepspeed", "accelerate", "tpe_train", "torch"):
        if f"/{name}/" in path:
            return name
    return "other"


def host_time(step: Any, steps: int, device: torch.device) -> dict[str, float]:
    """Own time per step (ms) by package, over ``steps`` steps under cProfile."""
    profile = cProfile.Profile()
    sync(device)
    profile.enable()
    for _ in range(steps):
        step()
    sync(device)
    profile.disable()
    totals = dict.fromkeys(PACKAGES, 0.0)
    for (filename, _, _), (_, _, own, _, _) in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        totals[package(filename)] += own * 1e3 / steps
    return totals


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        sys.exit(f"bench_engine.py: --device {args.device}, but torch sees no GPU; run with --device cpu")
    launch_environment(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = ["train.accumulate=1", "train.batch_tokens=0", "train.clip_norm=1.0"]  # one batch a step, clipped
    overrides = [*steps, f"train.bf16={str(args.bf16).lower()}", *(SMOKE_MODEL if args.smoke else [])]
    cfg = load_config(args.preset, overrides)
    ctx = ParallelContext.from_env(1, deepspeed=True)
    device = ctx.device
    shape = Uniform(size=args.batch, count=4, lo=max(2, args.length // 2), hi=args.length)
    batches = [
        Batch(torch.arange(args.batch), b.src, b.tgt_in, b.tgt_out)
        for b in shape.batches(cfg.data.vocab_size, 1, device)
    ]
    stages = [int(s) for s in args.stages.split(",") if s]
    rows = []
    for name, stage in [("plain", None), *((f"ZeRO-{s}", s) for s in stages)]:
        eng, turn = engine(cfg, ctx, stage, args.deepspeed_adamw == "fused"), iter(range(10**9))
        cast = torch.bfloat16 if args.bf16 and not eng.uses_deepspeed else None  # DeepSpeed: bf16 weights

        def step(eng: Engine = eng, turn: Any = turn, cast: torch.dtype | None = cast) -> None:
            train_step(eng, [batches[next(turn) % len(batches)]], cfg, ctx, cast)

        rows.append(FnRow(name, step))
    tokens = statistics.mean(b.target_tokens for b in batches)
    print(
        f"{args.preset}: d {cfg.model.d_model}, {cfg.model.encoder_layers} + {cfg.model.decoder_layers} "
        f"layers, {cfg.data.vocab_size} words; {args.batch} sentences, {tokens:.0f} target tokens a batch; "
        f"{device}{' bf16' if args.bf16 else ' fp32'}; torch {torch.__version__}; DeepSpeed rows' AdamW: "
        f"{args.deepspeed_adamw}"
    )
    interleave(rows, args.warmup, args.steps, device, "step")
    profiles = {row.name: host_time(row.step, args.profile_steps, device) for row in rows}
    base = statistics.median(rows[0].times)
    header = "".join(f"{p:>11s}" for p in PACKAGES)
    print(f"{'row':10s} {'median':>10s} {'p90':>10s} {'vs plain':>9s}   own host time per step, ms:{header}")
    figures = []
    for row in rows:
        median = statistics.median(row.times)
        cells = "".join(f"{profiles[row.name][p]:11.2f}" for p in PACKAGES)
        print(
            f"{row.name:10s} {median * 1e3:7.2f} ms {p90(row.times) * 1e3:7.2f} ms {median / base:8.2f}x"
            f"   {'':27s}{cells}"
        )
        figures.append(
            {"row": row.name, "median_ms": median * 1e3, "p90_ms": p90(row.times) * 1e3,
             "vs_plain": median / base, "host_ms_by_package": profiles[row.name]}
        )  # fmt: skip
    result = {
        "preset": args.preset,
        "bf16": args.bf16,
        "deepspeed_adamw": args.deepspeed_adamw,
        "rows": figures,
        "environment": environment(device),
    }
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
