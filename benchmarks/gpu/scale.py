"""The GPU goals of a step near the hardware, in one script (at most 8 minutes on one H200, set-up
included); CI has no GPU. The attention checks are ``attention.py``'s (this folder); this one the rest.

    python -m benchmarks.gpu.scale OUT_DIR [--data DIR]   # on a machine with a CUDA GPU (DeepSpeed
                                                          # installed for part 2)
    python -m benchmarks.gpu.scale OUT_DIR --dry-run      # the same parts on the CPU in their small
                                                          # modes, seconds (the CI smoke test runs it)

1. Memory (``bench_memory.py``, base preset, 64 x 64 tokens, bf16): peak allocated above the weights
   of the plain step against ``train.activation_checkpointing=layers``, with the whole batch's logits
   and with the output layer and loss in chunks. Goal: ``layers`` with chunks >= 2.5x lower.
2. DeepSpeed (``bench_engine.py``, big preset, 96 x 64 tokens, bf16): the trainer's step through the
   plain engine against ZeRO-1 and ZeRO-2 on one GPU, with each row's host time by package. Goal:
   ZeRO-1 <= 1.10x the plain step.
3. A micro-batch that fills the GPU (``bench_attention.py``, big preset, batches of ``--max-tokens``
   50,000 padded tokens, about 25,000 target tokens, bf16, sdpa): ``none``, ``sinusoidal`` and
   ``rope`` eager, ``none`` and ``sinusoidal`` compiled, and the Hugging Face peers, each row warmed
   twice over both batch shapes, 10 timed steps. Goals (``attention.summary``): MFU >= 40% of the
   bf16 matmul peak measured in the same rounds, compiled >= 1.3x eager, every encoding within 1.10x
   of ``none``, each encoding >= 1.3x its Hugging Face peer.
4. ``summary.txt``: each goal PASS or FAIL with its figure, or NOT MEASURED where its part failed;
   INFO for figures without a goal.

Each part is a subprocess with its own time limit; what it prints is teed to OUT_DIR/log.txt line by
line as it comes (a crash or a cut keeps the earlier figures) and its JSON kept: log.txt, memory.json,
engine.json, batch.json, summary.txt (5 files). Commit OUT_DIR under docs/results/gpu/. The exit
status is the number of goals not met (on the GPU) plus the parts that failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.gpu.attention import Log, Run
from benchmarks.gpu.attention import summary as attention_goals
from benchmarks.harness import ROOT

#: (met, text) per goal; met is None for a figure reported alongside without a goal
Goals = list[tuple[bool | None, str]]


def memory_goals(figures: dict[str, Any]) -> Goals:
    """Peak above the weights, plain over ``layers`` (``peak_ratio``: the plain row's peak / this row's)."""
    rows = {r["row"]: r for r in figures["rows"]}
    checks: Goals = []
    for name, row in rows.items():
        if name.startswith("layers/"):
            chunks = "chunks" in name  # the goal is with the loss in chunks
            text = f"memory: {name} peak {row['peak_ratio']:.2f}x lower than plain"
            checks.append((row["peak_ratio"] >= 2.5, f"{text} (goal >= 2.5x)") if chunks else (None, text))
    if not any("chunks" in name for name in rows if name.startswith("layers/")):
        checks.append((False, "memory: no row with layers and chunks"))
    return checks


def engine_goals(figures: dict[str, Any]) -> Goals:
    """ZeRO-1 against the plain step (ZeRO-2 reported alongside, no goal)."""
    checks: Goals = []
    for row in figures["rows"]:
        if row["row"] == "ZeRO-1":
            checks.append(
                (row["vs_plain"] <= 1.10, f"engine: ZeRO-1 {row['vs_plain']:.2f}x plain (goal <= 1.10x)")
            )
        elif row["row"] != "plain":
            checks.append((None, f"engine: {row['row']} {row['vs_plain']:.2f}x plain"))
    if not any(row["row"] == "ZeRO-1" for row in figures["rows"]):
        checks.append((False, "engine: no ZeRO-1 row"))
    return checks


@dataclass
class Part:
    name: str
    script: str
    gpu_args: list[str]
    dry_args: list[str]
    limit_s: float
    goals: Callable[[dict[str, Any]], Goals]


def parts(data: Path | None) -> list[Part]:
    steps = ["--warmup", "4", "--steps", "10"]  # 2 batch shapes, each warmed twice
    data_args = ["--data", str(data)] if data else []
    return [
        Part("memory", "bench_memory.py",
             ["--device", "cuda", "--bf16", "--modes", "none,layers", "--warmup", "1", "--steps", "3"],
             ["--smoke", "--threads", "1", "--modes", "none,layers"], 75, memory_goals),
        Part("engine", "bench_engine.py",
             ["--preset", "wmt14_en_de_big", "--batch", "96", "--length", "64", "--device", "cuda", "--bf16",
              "--stages", "1,2", "--warmup", "3", "--steps", "10", "--profile-steps", "5"],
             ["--smoke", "--threads", "1", "--stages", "1,2"], 120, engine_goals),
        Part("batch", "bench_attention.py",
             ["--preset", "wmt14_en_de_big", "--device", "cuda", "--bf16", "--max-tokens", "50000",
              "--batches", "2", "--kinds", "sinusoidal,rope", "--backends", "sdpa", "--compile-backends",
              "sdpa", "--compile-kinds", "sinusoidal", "--hf", "--decode", "none", *steps, *data_args],
             ["--smoke", "--threads", "1", "--kinds", "sinusoidal", "--hf", "--decode", "none", *data_args],
             240, attention_goals),
    ]  # fmt: skip


def run_part(cmd: list[str], limit_s: float, log: Log) -> int:
    """Run ``cmd``, each line of its output to ``log`` as it comes; stopped after ``limit_s`` (-1)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    timer = threading.Timer(limit_s, proc.kill)
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            log(line.rstrip("\n"))
        code = proc.wait()
    finally:
        cut = not timer.is_alive()
        timer.cancel()
    if cut:
        log(f"(stopped after its limit of {limit_s:.0f} s)")
        return -1
    return code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, help="folder for the raw output")
    p.add_argument("--data", type=Path, help="the shared data folder for part 3 (default ../shared/data)")
    p.add_argument("--dry-run", action="store_true", help="CPU, small modes: exercise every code path")
    args = p.parse_args(argv)
    run = Run.start(args.out, args.dry_run, "benchmarks.gpu.scale")
    if run is None:
        return 2
    gpu, log = run.gpu, run.log
    lines, failures = [], 0
    for i, part in enumerate(parts(args.data), 1):
        out = args.out / f"{part.name}.json"
        cmd = [sys.executable, str(ROOT / "benchmarks" / part.script),
               *(part.gpu_args if gpu else part.dry_args), "--json", str(out)]  # fmt: skip
        log(f"\n{i}. {part.name}: {' '.join(cmd[1:])}  ({run.elapsed():.0f} s so far)")
        code = run_part(cmd, part.limit_s, log)
        if code != 0 or not out.exists():
            lines.append(f"NOT MEASURED {part.name}: {part.script} exited with {code} (see log.txt)")
            failures += 1
            continue
        for ok, text in part.goals(json.loads(out.read_text())):
            lines.append(f"{'INFO' if ok is None else 'PASS' if ok else 'FAIL'} {text}")
            failures += gpu and ok is False  # the dry run's CPU figures are not the goals
    run.finish(lines, "\ngoals\n")
    return int(failures)


if __name__ == "__main__":
    sys.exit(main())
