"""The cost of position diagnostics during training at the demo preset, measured in one process.

Run from the repository root::

    python docs/results/diagnostics-overhead/measure.py                      # the demo preset
    python docs/results/diagnostics-overhead/measure.py model.position.kind=learned

The run is set up as ``tpe-train`` sets it up (``tpe_train.train.loop``: data, micro-batch plan, engine,
the fixed diagnostics batch); then, after 3 warm-up steps and one warm-up measurement, each round
trains ``--steps`` steps, each timed, and then takes one diagnostics measurement
(``TrainingDiagnostics.write``: the forward of the fixed batch with the attention probes, the merge,
the TensorBoard scalars and, for a learned table, the images), timed. Interleaving puts a load change
on a shared machine into both figures alike. Reported: the median step and diagnostics times, wall
clock and the process's CPU time (all threads: less sensitive to other processes on a shared machine),
the median over rounds of the round's diagnostics time / its median step time, and the cost at
``train.diagnostics_every`` = N: that ratio / N, the share of training time added.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

import torch
from torch.utils.tensorboard import SummaryWriter

from tpe_train.config import load_config
from tpe_train.data.train_batches import TrainBatches
from tpe_train.parallel.context import ParallelContext
from tpe_train.parallel.deepspeed import resolve_layout
from tpe_train.train import batch_size
from tpe_train.train.build import build_engine, build_train_model
from tpe_train.train.cpu_setup import configure_cpu
from tpe_train.train.position_logging import TrainingDiagnostics
from tpe_train.train.precision import autocast_dtype
from tpe_train.train.seeding import seed_everything
from tpe_train.train.startup import prepare_data
from tpe_train.train.step import train_step


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", help="config overrides of the demo preset")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=4, help="training steps per round")
    parser.add_argument("--json", default=None, help="also write every timing here")
    args = parser.parse_args()
    cfg = load_config("demo", [*args.overrides, f"train.run_dir={tempfile.mkdtemp()}"])
    layout = resolve_layout(cfg)
    ctx = ParallelContext.from_env(layout.tp_size)
    seed_everything(cfg.train.seed)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    configure_cpu(cfg.train.cpu_gemm, ctx.device)
    data = prepare_data(cfg, ctx)
    cfg, _ = batch_size.plan(cfg, data, ctx, start_recorded=False)
    engine = build_engine(build_train_model(cfg, data.tokenizer.get_vocab_size(), ctx), cfg, ctx, None)
    amp_dtype = autocast_dtype(cfg, engine.uses_deepspeed)
    batches = TrainBatches(data, cfg.data, cfg.train.seed)
    diagnostics = TrainingDiagnostics.of_run(cfg, data, ctx)
    assert diagnostics is not None, "train.diagnostics_every=0: nothing to measure"
    writer = SummaryWriter(tempfile.mkdtemp())

    def timed(fn: Any) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - wall, time.process_time() - cpu

    def step() -> tuple[float, float]:
        micro = [next(batches) for _ in range(cfg.train.accumulate)]
        return timed(lambda: train_step(engine, micro, cfg, ctx, amp_dtype))

    def diagnose(at: int) -> tuple[float, float]:
        return timed(lambda: diagnostics.write(engine, writer, ctx, at, amp_dtype))

    for _ in range(3):
        step()
    diagnose(0)
    rounds: list[tuple[list[tuple[float, float]], tuple[float, float]]] = []
    for r in range(args.rounds):
        steps = [step() for _ in range(args.steps)]
        rounds.append((steps, diagnose(r + 1)))
    writer.close()
    every = cfg.train.diagnostics_every
    print(f"preset demo {' '.join(args.overrides)} | position {cfg.model.position.kind} | threads "
          f"{torch.get_num_threads()} | diagnostics batch {tuple(diagnostics.src.shape)} src, "
          f"{tuple(diagnostics.tgt_in.shape)} tgt_in | {args.rounds} rounds of {args.steps} steps + 1 "
          "diagnostics")  # fmt: skip
    for k, clock in enumerate(("wall", "cpu")):
        steps_all = [s[k] for steps, _ in rounds for s in steps]
        diags = [d[k] for _, d in rounds]
        ratio = statistics.median(d[k] / statistics.median(s[k] for s in steps) for steps, d in rounds)
        ms = lambda xs: f"{statistics.median(xs) * 1e3:.1f} ms ({min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f})"  # noqa: E731
        print(f"{clock:4}: step median {ms(steps_all)} | diagnostics median {ms(diags)} | "
              f"diagnostics / step, median of rounds: {ratio:.3f}")  # fmt: skip
        costs = ", ".join(f"every {n}: {100 * ratio / n:.2f}%" for n in sorted({every, 10, 50, 100, 500}))
        print(f"      share of training time added ({clock}; default every {every}): {costs}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"overrides": args.overrides, "every": every, "rounds": rounds}, f)


if __name__ == "__main__":
    main()
