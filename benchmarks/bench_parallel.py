"""Distributed layouts side by side on this machine: step time and memory per rank.

    DS_ACCELERATOR=cpu python benchmarks/bench_parallel.py [--steps 60] [--kind t5] [--json out.json]

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
1-process and TP=2 runs for T5, ALiBi and learned for one step each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]

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
        cfg = ROOT / "configs" / "accelerate" / launch
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg)]
        cmd += ["-m", "tpe_train.train", "train.threads=1", *common]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TPE_DATA_CACHE": str(data)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    tokens_per_s = [e.value for e in acc.Scalars("train/tokens_per_s")]
    memory = json.loads((run_dir / "memory.json").read_text())[0]
    return {"tokens_per_s": tokens_per_s, "memory": memory}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kind", default="t5", help="position encoding of the step-time rows")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tpe-bench-parallel-"))
    data = work / "data"
    steps = [f"train.max_steps={args.steps}", "train.log_every=5", f"model.position.kind={args.kind}"]
    rows: dict[str, Any] = {}
    for name, launch in LAYOUTS.items():
        r = run(launch, steps, work / name.replace(" ", "_").replace("=", ""), data)
        r["median_tokens_per_s"] = statistics.median(r["tokens_per_s"][1:])
        rows[name] = r
        print(f"{name:10s} {r['median_tokens_per_s']:9.0f} tokens/s", flush=True)

    def step_ratio(a: str, b: str, batches_a: int, batches_b: int) -> float:
        # step time ratio = (batches per step / tokens per s) of a over that of b
        return (batches_a / rows[a]["median_tokens_per_s"]) / (batches_b / rows[b]["median_tokens_per_s"])

    figures: dict[str, Any] = {
        "zero2_over_ddp_step_time": step_ratio("ZeRO-2 x2", "DDP x2", 2, 2),
        "zero3_over_ddp_step_time": step_ratio("ZeRO-3 x2", "DDP x2", 2, 2),
        "tp2_over_tp1_step_time": step_ratio("TP=2", "1 process", 1, 1),
    }
    one, z3 = rows["1 process"]["memory"], rows["ZeRO-3 x2"]["memory"]
    figures["zero3_param_plus_optimizer_ratio"] = (z3["parameters"] + z3["optimizer"]) / (
        one["parameters"] + one["optimizer"]
    )
    print("\nmemory per rank (bytes)           parameters   gradients   optimizer   positions")
    for name, r in rows.items():
        m = r["memory"]
        sizes = " ".join(f"{m[k]:11,}" for k in ("parameters", "gradients", "optimizer", "positions"))
        print(f"  {name:30s} {sizes}")
    for kind in ("t5", "alibi", "learned"):
        one_step = ["train.max_steps=1", f"model.position.kind={kind}"]
        full = run(None, one_step, work / f"pos1-{kind}", data)["memory"]["positions"]
        split = run("cpu_tp2.yaml", one_step, work / f"pos2-{kind}", data)["memory"]["positions"]
        figures[f"tp2_position_bytes_ratio_{kind}"] = split / full
        print(f"position tables, {kind:8s}: 1 process {full:8,} B, TP=2 {split:8,} B per rank")
    print()
    for name, value in figures.items():
        print(f"{name:36s} {value:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "figures": figures}, indent=2))


if __name__ == "__main__":
    main()
