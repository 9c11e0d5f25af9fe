"""Where a training step of ``bench_train.py``'s workload spends its time, op by op (CPU).

    python benchmarks/profile_step.py                       # bf16 sinusoidal, 5 profiled steps
    python benchmarks/profile_step.py --dtype fp32 --kind rope --steps 3 --top 30
    python benchmarks/profile_step.py --timer ops --threads 1   # every op timed directly, GEMMs by shape
    python benchmarks/profile_step.py --smoke --timer ops        # small mode: a tiny shape, 1 + 1 steps

The same model, batches, loss and optimizer as ``bench_train.py``'s training rows (``harness.TrainRow``
on ``harness.BENCH_SHAPE`` and ``harness.Uniform`` batches),
run as the trainer runs (``tpe_train.train.cpu_setup.configure_cpu``). After ``--warmup`` steps, ``--steps``
steps run under ``torch.profiler``; printed:

- the ops with the most self CPU time (their own time, not their children's), with calls and the
  share of the step;
- self CPU time in four groups: GEMMs (``addmm``, ``mm``, ``bmm``, ``baddbmm`` and oneDNN's linear ops;
  self time, so a wrapper such as ``linear`` is not counted twice), copies and casts (``copy_``,
  ``to``, ``_to_copy``, ``clone``, ``contiguous``), the optimizer's own time, and everything else;
- every dtype cast (``_to_copy``) by input shape, most time first (time with its ``copy_``): under
  autocast these are the copies bf16 pays for that fp32 does not.

Numbers come from one process on a possibly busy machine: read them as shares of one step.

``--timer ops`` times every ATen op of the steps by wall clock instead (a ``TorchDispatchMode`` around
each call, no profiler: the profiler's own bookkeeping inflated the many small copies of the bf16 loss
several times over), and prints the ops by time and every GEMM by operand shapes and layout with its
GFLOP/s: which products run below the machine's peak, and how much of the step is not a GEMM.
It ends with the ceiling: the model FLOPs of a step (``bench_train.py``'s count) against the GEMM
peak of the step's dtype measured right after (``bench_train.py``'s shapes and kernels, median of 5),
for the whole step and for a step that did nothing but its GEMMs at the rates they ran at in it. On 2
threads a 1-thread profile misleads: the output layer's bf16 product ran at 660-800 GFLOP/s on one
thread with the weight as ``F.linear`` takes it and at 1,600 with the weight transposed, but at about
3,000 on two threads either way.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from harness import (
    DTYPES,
    SMOKE_BATCHES,
    TrainRow,
    Uniform,
    bench_config,
    build,
    gemm_shapes,
    model_args,
    parse_with_smoke,
)
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from tpe_train.train import cpu_setup, throughput

GEMM = ("aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm", "aten::_mkldnn_linear",
        "mkldnn::_linear_pointwise", "aten::mkldnn_linear_backward_weights", "aten::mkldnn_linear",
        "aten::mkldnn_linear_backward_input")  # fmt: skip
COPIES = ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::to")
OPTIMIZER = ("Optimizer.step",)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", default="sinusoidal", help="position encoding of the tpe_train model")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--top", type=int, default=25, help="ops listed by self CPU time")
    p.add_argument("--timer", choices=("profiler", "ops"), default="profiler",
                   help="torch.profiler (default), or every ATen op timed by wall clock")  # fmt: skip
    return parse_with_smoke(p, argv, {"warmup": 1, "steps": 1})  # and a tiny shape


#: GEMM ops of the ops timer: positions of the two operands, and whether the second is (N, K) as
#: oneDNN's inner product takes it (``model/kernels.py``'s fp32 training products) instead of (K, N).
_MATMULS = {
    torch.ops.aten.mm.default: (0, 1, False),
    torch.ops.aten.addmm.default: (1, 2, False),
    torch.ops.aten.bmm.default: (0, 1, False),
    torch.ops.aten.baddbmm.default: (1, 2, False),
}
if hasattr(torch.ops.mkldnn, "_linear_pointwise"):
    _MATMULS[torch.ops.mkldnn._linear_pointwise.default] = (0, 1, True)


class OpTimer(TorchDispatchMode):
    """Wall-clock time of every ATen op run inside it; GEMMs keyed by operand shapes and layout."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[tuple[str, ...], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # calls, s, FLOPs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        seconds = time.perf_counter() - start
        key: tuple[str, ...] = (func.__name__,)
        flops = 0.0
        if func in _MATMULS:
            i, j, n_k = _MATMULS[func]
            a, b = args[i], args[j]
            flops = 2.0 * a.numel() * b.shape[0 if n_k else -1]
            layout = "".join("c" if t.is_contiguous() else "t" for t in (a, b))
            key = (
                func.__name__,
                f"{tuple(a.shape)}@{tuple(b.shape)}",
                layout,
                str(a.dtype).removeprefix("torch."),
            )
        entry = self.ops[key]
        entry[0], entry[1], entry[2] = entry[0] + 1, entry[1] + seconds, entry[2] + flops
        return out


def time_ops(
    row: TrainRow, steps: int, top: int, model_flops: int, shapes: list[tuple[int, int, int]]
) -> None:
    """``--timer ops``: every op's wall time per step, and every GEMM shape's rate."""
    timer = OpTimer()
    with timer:
        start = time.perf_counter()
        for _ in range(steps):
            row.step()
        wall = (time.perf_counter() - start) / steps
    ops = timer.ops
    in_ops = sum(v[1] for v in ops.values()) / steps
    gemm = [(k, v) for k, v in ops.items() if v[2]]
    gemm_s = sum(v[1] for _, v in gemm) / steps
    rate = sum(v[2] for _, v in gemm) / steps / gemm_s / 1e9
    print(f"{row.name} {row.dtype}, {torch.get_num_threads()} threads: step {wall * 1e3:.0f} ms (wall), "
          f"{in_ops * 1e3:.0f} ms in ATen ops, of which GEMMs {gemm_s * 1e3:.0f} ms ({gemm_s / wall:.0%} of "
          f"the step) at {rate:.0f} GFLOP/s")  # fmt: skip
    print(f"\n{'ms/step':>8} {'calls':>6}  op (GEMMs: operands, layout c=contiguous t=transposed, dtype)")
    for key, (calls, seconds, flops) in sorted(ops.items(), key=lambda kv: -kv[1][1])[:top]:
        gflops = f"  {flops / seconds / 1e9:.0f} GFLOP/s" if flops else ""
        print(f"{seconds / steps * 1e3:>8.2f} {calls / steps:>6.0f}  {' '.join(key)}{gflops}")
    # The ceiling: model FLOPs (the bench's count) over the GEMMs' own time, against the peak now.
    peak = throughput.measure_peak(DTYPES[row.dtype], torch.device("cpu"), shapes, reps=5).gflops(
        statistics.median
    )
    print(
        f"\nmodel FLOPs {model_flops / 1e9:.1f} GFLOP a step; {row.dtype} GEMM peak measured now "
        f"{peak:.0f} GFLOP/s (best shape and kernel, median of 5): the step (timed above) at "
        f"{model_flops / wall / 1e9 / peak:.1%} of it; a step of only its GEMMs, each at its rate in the "
        f"step, at {model_flops / gemm_s / 1e9 / peak:.1%}"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu_setup.configure_cpu("auto", torch.device("cpu"))
    cfg, uniform = bench_config(args.smoke), SMOKE_BATCHES if args.smoke else Uniform()
    cpu = torch.device("cpu")
    batches = uniform.batches(cfg.data.vocab_size, 0, cpu)
    row = TrainRow(args.kind, build(cfg, args.kind), batches, cpu, cfg.train, args.dtype)
    for _ in range(args.warmup):
        row.step()
    if args.timer == "ops":
        flops = throughput.train_flops(model_args(cfg), [(uniform.size, uniform.hi, uniform.hi + 1)])
        time_ops(row, args.steps, args.top, flops, gemm_shapes(model_args(cfg)))
        return
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(args.steps):
            row.step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)  # microseconds, over all profiled steps
    per_step = total / args.steps / 1e3
    print(f"{args.kind} {args.dtype}, {torch.get_num_threads()} threads: {per_step:.1f} ms self CPU per step")
    print(f"{'op':<44} {'calls/step':>10} {'ms/step':>9} {'share':>7}")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[: args.top]:
        ms, share = e.self_cpu_time_total / args.steps / 1e3, e.self_cpu_time_total / total
        print(f"{e.key[:44]:<44} {e.count / args.steps:>10.1f} {ms:>9.2f} {share:>7.1%}")
    groups: dict[str, float] = defaultdict(float)
    for e in events:
        key = ("gemm" if e.key in GEMM else "copies and casts" if e.key in COPIES
               else "optimizer" if e.key.startswith(OPTIMIZER) else "everything else")  # fmt: skip
        groups[key] += e.self_cpu_time_total
    print()
    for key, us in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"{key:<20} {us / args.steps / 1e3:>9.2f} ms/step {us / total:>7.1%}")
    casts = [e for e in prof.key_averages(group_by_input_shape=True) if e.key == "aten::_to_copy"]
    print("\ncasts (aten::_to_copy) by input shape, most time first:")
    for e in sorted(casts, key=lambda e: -e.cpu_time_total)[:15]:
        ms = e.cpu_time_total / args.steps / 1e3
        print(f"  {ms:>7.2f} ms/step {e.count / args.steps:>5.1f}x  {str(e.input_shapes)[:90]}")


if __name__ == "__main__":
    main()
