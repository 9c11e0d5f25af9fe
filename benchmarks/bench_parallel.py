"""Distributed layouts side by side on this machine: step time and memory per rank.

    DS_ACCELERATOR=cpu python benchmarks/bench_parallel.py [--steps 60] [--kind t5] [--json out.json]
    DS_ACCELERATOR=cpu python benchmarks/bench_parallel.py --smoke --json out.json   # small mode: a tiny
                                                  # model, 2 steps, 1 process and TP=2 only, t5 positions

Every row is a real ``tpe-train`` run of the demo preset (d 128, 4 heads, 3 + 3 layers, 4,096-token
batches), started the way a user starts it:

- ``1 process``: ``tpe-train`` alone (2 threads), the tensor-parallel size 1 reference;
- ``DDP x2``: ``accelerate launch --config_file configs/accelerate/cpu_ddp.yaml`` (2 processes x 1 thread);
- ``ZeRO-2 x2`` and ``ZeRO-3 x2``: ``cpu_zero2.yaml`` / ``cpu_zero3.yaml``;
- ``TP=2``: ``cpu_tp2.yaml`` (AutoTP over 2 processes x 1 thread, ZeRO-1 over a data-parallel size of 1).

Step time is the median over logging windows (the first one, with warm-up, is dropped) of target
tokens per step / tokens per second, both read back from the run's TensorBoard events. Data-parallel
rows take two batches per step (one per rank), the others one; the ratios compare like with like:
ZeRO-2 and ZeRO-3 against DDP (same global batch), TP=2 against one process (same batch).
Memory is each run's start-up report (``memory.json``), rank 0. The position-table rows repeat the
1-process and TP=2 runs for T5, ALiBi and learned for one step each (``--position-kinds``); where a
layout row above ran that encoding already, its start-up report serves (it does not depend on the
steps). A ratio whose rows were left out (``--layouts``) is not printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness import ROOT, SMOKE_MODEL, accelerate_cmd, parse_with_smoke, run_checked, tb_scalars, write_json

LAYOUTS = {
    "1 process": None,
    "DDP x2": "cpu_ddp.yaml",
    "ZeRO-2 x2": "cpu_zero2.yaml",
    "ZeRO-3 x2": "cpu_zero3.yaml",
    "TP=2": "cpu_tp2.yaml",
}


def run(launch: str | None, overrides: list[str], run_dir: Path, data: Path) -> dict[str, Any]:
    common = [
        f"train.run_dir={run_dir}",
        "train.progress=false",
        "train.valid_bleu_size=0",
        "eval.at_end=false",
        "data.synthetic.train_size=6000",
        *overrides,
    ]
    if launch is None:
        cmd = [sys.executable, "-m", "tpe_train.train", "train.threads=2", *common]
    else:
        cmd = [*accelerate_cmd(ROOT / "configs" / "accelerate" / launch), "-m", "tpe_train.train"]
        cmd += ["train.threads=1", *common]
    run_checked(cmd, env={**os.environ, "DS_ACCELERATOR": "cpu", "TPE_DATA_CACHE": str(data)})
    memory = json.loads((run_dir / "memory.json").read_text())[0]
    return {"tokens_per_s": tb_scalars(run_dir, "train/tokens_per_s"), "memory": memory}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kind", default="t5", help="position encoding of the step-time rows")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"some of: {', '.join(LAYOUTS)}")
    parser.add_argument(
        "--position-kinds", default="t5,alibi,learned", help="encodings of the position-table rows"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    # small mode: besides these, a tiny model (harness.SMOKE_MODEL)
    args = parse_with_smoke(parser, None, {"steps": 2, "layouts": "1 process,TP=2", "position_kinds": "t5"})
    unknown = set(args.layouts.split(",")) - set(LAYOUTS)
    if unknown:
        parser.error(f"unknown layout(s) {sorted(unknown)}; choose from {', '.join(LAYOUTS)}")
    return args


def main() -> None:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="tpe-bench-parallel-"))
    data = work / "data"
    small = [*SMOKE_MODEL, "data.synthetic.train_size=2000"] if args.smoke else []
    log_every = 1 if args.smoke else 5
    steps = [
        f"train.max_steps={args.steps}",
        f"train.log_every={log_every}",
        f"model.position.kind={args.kind}",
    ]
    steps += small
    rows: dict[str, Any] = {}
    for name in (n for n in LAYOUTS if n in args.layouts.split(",")):
        r = run(LAYOUTS[name], steps, work / name.replace(" ", "_").replace("=", ""), data)
        r["median_tokens_per_s"] = statistics.median(r["tokens_per_s"][1:] or r["tokens_per_s"])
        rows[name] = r
        print(f"{name:10s} {r['median_tokens_per_s']:9.0f} tokens/s", flush=True)

    def step_ratio(a: str, b: str, batches_a: int, batches_b: int) -> float:
        # step time ratio = (batches per step / tokens per s) of a over that of b
        return (batches_a / rows[a]["median_tokens_per_s"]) / (batches_b / rows[b]["median_tokens_per_s"])

    figures: dict[str, Any] = {}
    for key, a, b, batches in (
        ("zero2_over_ddp_step_time", "ZeRO-2 x2", "DDP x2", 2),
        ("zero3_over_ddp_step_time", "ZeRO-3 x2", "DDP x2", 2),
        ("tp2_over_tp1_step_time", "TP=2", "1 process", 1),
    ):
        if a in rows and b in rows:
            figures[key] = step_ratio(a, b, batches, batches)
    if "1 process" in rows and "ZeRO-3 x2" in rows:
        one, z3 = rows["1 process"]["memory"], rows["ZeRO-3 x2"]["memory"]
        figures["zero3_param_plus_optimizer_ratio"] = (z3["parameters"] + z3["optimizer"]) / (
            one["parameters"] + one["optimizer"]
        )
    print("\nmemory per rank (bytes)           parameters   gradients   optimizer   positions")
    for name, r in rows.items():
        m = r["memory"]
        sizes = " ".join(f"{m[k]:11,}" for k in ("parameters", "gradients", "optimizer", "positions"))
        print(f"  {name:30s} {sizes}")

    def positions(layout: str, kind: str) -> int:
        """Position-table bytes per rank of ``layout`` with ``kind`` (start-up report of one step)."""
        if kind == args.kind and layout in rows:
            return int(rows[layout]["memory"]["positions"])
        one_step = ["train.max_steps=1", f"model.position.kind={kind}", *small]
        return int(
            run(LAYOUTS[layout], one_step, work / f"pos-{layout[:3]}-{kind}", data)["memory"]["positions"]
        )

    for kind in (k for k in args.position_kinds.split(",") if k):
        full, split = positions("1 process", kind), positions("TP=2", kind)
        figures[f"tp2_position_bytes_ratio_{kind}"] = split / full if full else float("nan")
        print(f"position tables, {kind:8s}: 1 process {full:8,} B, TP=2 {split:8,} B per rank")
    print()
    for name, value in figures.items():
        print(f"{name:36s} {value:.3f}")
    write_json(args.json, {"rows": rows, "figures": figures})


if __name__ == "__main__":
    main()
