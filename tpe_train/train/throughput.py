"""Model FLOPs, the hardware's measured GEMM peaks and MFU: one copy for the trainer and the benchmark.

MFU (model FLOPs utilisation) = model FLOP/s / the best GEMM rate this machine reaches in the run's
precision, measured on this machine, by the same process:

- **Model FLOPs** (``forward_flops``): matrix-product FLOPs only, 2 per multiply-add, training = 3 x
  forward, at the *padded* lengths Ls, Lt, with d = d_model, f = FFN width, V = vocabulary, per layer:
  encoder 8·Ls·d² (q, k, v, out) + 4·Ls²·d (scores and weighted sum) + 4·Ls·d·f (FFN); decoder
  self-attention 8·Lt·d² + 4·Lt²·d (the full square, not halved for causality); cross-attention
  4·Lt·d² (q, out) + 4·Ls·d² (k, v) + 4·Lt·Ls·d; decoder FFN 4·Lt·d·f; output layer 2·Lt·d·V once.
  Embeddings, norms, softmax, the loss, position-encoding extras and the optimizer are not counted,
  so every model of one shape does the same model FLOPs whatever its encoding.
- **Peak** (``measure_peak``): GFLOP/s of the ways this machine multiplies two matrices of the run's
  dtype (``gemm_kernels``): PyTorch's own (MKL for fp32 on x86 CPUs), oneDNN's, and for bf16 on a
  CPU also the operands widened to fp32 (what ``model/kernels.py`` does where the CPU has no bf16
  kernels). The peak is the best rate over kernels and the model's shapes, so a model that uses the
  fastest kernel for every product and nothing else would reach 100%, and none can pass it.

``Throughput`` is the trainer's meter: tokens/s and MFU over each logging window, the peak measured
once at start-up (about a second) or taken from ``train.peak_gflops``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from tpe_train.config import Config
from tpe_train.data.batching import Batch, model_args
from tpe_train.model.args import ModelArgs
from tpe_train.model.kernels import _ONEDNN, cpu_rules
from tpe_train.parallel.context import ParallelContext
from tpe_train.train.precision import compute_dtype

Kernel = Callable[[Tensor, Tensor], Tensor]  # (M, K), (N, K) -> (M, N)


def forward_flops(
    d_model: int, ffn_dim: int, encoder_layers: int, decoder_layers: int, vocab: int, ls: int, lt: int
) -> dict[str, int]:
    """Matmul FLOPs of one forward pass of one sentence at padded lengths (ls, lt), by part."""
    d, f = d_model, ffn_dim
    parts = {
        "encoder": encoder_layers * (8 * ls * d * d + 4 * ls * ls * d + 4 * ls * d * f),
        "decoder_self": decoder_layers * (8 * lt * d * d + 4 * lt * lt * d),
        "decoder_cross": decoder_layers * (4 * lt * d * d + 4 * ls * d * d + 4 * lt * ls * d),
        "decoder_ffn": decoder_layers * 4 * lt * d * f,
        "output": 2 * lt * d * vocab,
    }
    parts["total"] = sum(parts.values())
    return parts


def train_flops(args: ModelArgs, shapes: Sequence[tuple[int, int, int]]) -> int:
    """Model FLOPs of forward + backward over batches of (sentences, padded Ls, padded Lt)."""
    return sum(
        3
        * b
        * forward_flops(
            args.d_model, args.ffn_dim, args.encoder_layers, args.decoder_layers, args.vocab_size, ls, lt
        )["total"]
        for b, ls, lt in shapes
    )


# ------------------------------------------------------------------------------------ peaks


def _onednn(a: Tensor, b: Tensor) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")


def _widened(fp32: Kernel) -> Kernel:
    def kernel(a: Tensor, b: Tensor) -> Tensor:
        return fp32(a.float(), b.float()).to(torch.bfloat16)

    return kernel


def gemm_kernels(dtype: torch.dtype, device: torch.device, native_bf16: bool = True) -> dict[str, Kernel]:
    """The ways this machine multiplies matrices of ``dtype``: PyTorch's ``F.linear`` (MKL for fp32
    on x86 CPUs), oneDNN's inner product, and on a CPU for bf16 the operands widened to fp32 (with
    either fp32 kernel). ``native_bf16=False`` leaves out PyTorch's bf16 kernel where the CPU has no
    bf16 kernels (``model.kernels.cpu_rules``): it is far slower there, and slow to measure."""
    cpu = device.type == "cpu"
    kernels: dict[str, Kernel] = {}
    if not (cpu and dtype == torch.bfloat16 and cpu_rules()[1] and not native_bf16):
        kernels["torch"] = F.linear
    if cpu and _ONEDNN and dtype == torch.float32:
        kernels["onednn"] = _onednn
    if cpu and dtype == torch.bfloat16:
        kernels["widened-torch"] = _widened(F.linear)
        if _ONEDNN:
            kernels["widened-onednn"] = _widened(_onednn)
    return kernels


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Peak:
    """GFLOP/s per (shape, kernel), from timed repetitions; ``gflops``: the best of them."""

    dtype: torch.dtype
    device: torch.device
    kernels: dict[str, Kernel]
    shapes: list[tuple[int, int, int]]  # (M, K, N): (M, K) x (K, N)
    clock: Callable[[], float] = time.perf_counter  # time.thread_time: CPU time of one thread
    samples: dict[tuple[str, str], list[float]] = field(default_factory=dict)  # (shape, kernel) -> rates
    _operands: dict[tuple[int, int, int], tuple[Tensor, Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        for m, k, n in self.shapes:
            a, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
            self._operands[(m, k, n)] = (a.to(self.device, self.dtype), b.to(self.device, self.dtype))
        for a, b in self._operands.values():  # untimed first call of every kernel and shape
            for kernel in self.kernels.values():
                kernel(a, b)

    def sample(self, reps: int = 1, warm: int = 2) -> None:
        """Time every kernel on every shape ``reps`` times, each after ``warm`` untimed calls of it.

        The untimed calls: on the Intel Xeon with AMX a bf16 product called after other work ran at
        1,200-1,760 GFLOP/s (2 threads) and at 2,400-3,300 from its third call in a row on. Timing the
        cold calls understated the peak (by 1.2-1.5x in the benchmark's median) and so overstated
        MFU; the peak is the rate the hardware sustains, warm."""
        for (m, k, n), (a, b) in self._operands.items():
            for name, kernel in self.kernels.items():
                for _ in range(warm):
                    kernel(a, b)
                for _ in range(reps):
                    _sync(self.device)
                    start = self.clock()
                    kernel(a, b)
                    _sync(self.device)
                    rate = 2 * m * k * n / (self.clock() - start) / 1e9
                    self.samples.setdefault((f"{m}x{k}@{k}x{n}", name), []).append(rate)

    def table(self, statistic: Callable[[list[float]], float] = max) -> dict[str, dict[str, float]]:
        """shape -> kernel -> GFLOP/s (``statistic`` of its samples: the best, or the median)."""
        out: dict[str, dict[str, float]] = {}
        for (shape, kernel), rates in self.samples.items():
            out.setdefault(shape, {})[kernel] = statistic(rates)
        return out

    def gflops(self, statistic: Callable[[list[float]], float] = max) -> float:
        return max(rate for row in self.table(statistic).values() for rate in row.values())


def measure_peak(
    dtype: torch.dtype,
    device: torch.device,
    shapes: Sequence[tuple[int, int, int]],
    reps: int = 3,
    native_bf16: bool = True,
) -> Peak:
    """The machine's GEMM peak in ``dtype`` on ``shapes``: best of ``reps`` timings per kernel."""
    peak = Peak(dtype, device, gemm_kernels(dtype, device, native_bf16), list(shapes))
    peak.sample(reps)
    return peak


def model_shapes(args: ModelArgs, device: torch.device) -> list[tuple[int, int, int]]:
    """Where the peak is measured: the model's two FFN products, the largest of its layers' GEMMs, at
    1,024 tokens on a CPU (near its peak already); on a GPU at 16,384 tokens and an 8,192-cube, which
    a GPU needs to come near its peak (a small product would understate it and overstate MFU)."""
    rows = 1024 if device.type == "cpu" else 16384
    shapes = [(rows, args.d_model, args.ffn_dim), (rows, args.ffn_dim, args.d_model)]
    return shapes if device.type == "cpu" else [*shapes, (8192, 8192, 8192)]


# ---------------------------------------------------------------------------- the trainer


class Throughput:
    """Target tokens/s and MFU of training steps over a logging window, as this rank sees them.

    Per device: a tensor-parallel group shares each batch's FLOPs over its ``tp_size`` devices; data-
    parallel ranks each count their own batches (rank 0's figure stands for all). The peak is the
    device's in the run's precision (``dtype``), measured at construction unless ``peak_gflops``."""

    def __init__(
        self,
        args: ModelArgs,
        dtype: torch.dtype,
        device: torch.device,
        tp_size: int = 1,
        peak_gflops: float = 0.0,
        enabled: bool = True,
    ) -> None:
        self.args, self.tp_size = args, tp_size
        self.peak = peak_gflops
        self._measure: Callable[[], float] | None = None  # None: the peak was given (train.peak_gflops)
        if enabled and not peak_gflops:
            shapes = model_shapes(args, device)
            self._measure = lambda: measure_peak(dtype, device, shapes, native_bf16=False).gflops()
            self.peak = self._measure()
        self.flops, self.start = 0.0, time.perf_counter()

    @classmethod
    def of_run(cls, cfg: Config, vocab_size: int, ctx: ParallelContext) -> Throughput:
        """The meter of a training run (the peak is measured on the main rank only, which logs)."""
        dtype = compute_dtype(cfg.train)
        args = model_args(cfg.model, vocab_size)
        return cls(args, dtype, ctx.device, ctx.tp_size, cfg.train.peak_gflops, enabled=ctx.is_main)

    def step(self, batches: Sequence[Batch]) -> None:
        """One optimizer step over ``batches`` (this rank's)."""
        shapes = [(b.src.shape[0], b.src.shape[1], b.tgt_in.shape[1]) for b in batches]
        self.flops += train_flops(self.args, shapes) / self.tp_size

    def read(self, tokens: float) -> dict[str, float]:
        """``train/tokens_per_s`` (``tokens``: the target tokens trained since the last read, all
        ranks) and ``train/mfu`` since the last read; starts a new window."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        out = {"train/tokens_per_s": tokens / elapsed}
        rate = self.flops / elapsed / 1e9
        if self._measure is not None and rate > self.peak:
            # The start-up measurement was low (other processes shared the cores then, as two runs of a
            # study starting together do): measure again, and the step's own rate bounds it from below.
            self.peak = max(self.peak, self._measure(), rate)
        if self.peak:
            out["train/mfu"] = rate / self.peak
        self.flops, self.start = 0.0, time.perf_counter()
        return out
