"""Linear layers whose kernels are chosen by device: oneDNN for CPU inference and training, bf16 widened.

On x86 CPUs PyTorch sends fp32 ``F.linear`` to MKL's sgemm. MKL runs its AVX-512 kernels only on
Intel processors; oneDNN (bundled with PyTorch; the path PyTorch's compiler takes for frozen CPU
weights) runs them on any. On the AVX-512 AMD EPYC this project was first measured on, oneDNN computed
the same products 1.2-1.7x faster; on an AVX2-only EPYC both run AVX2 kernels and MKL was as fast or
faster on every product (one thread, CPU time; ``benchmarks/bench_train.py`` prints the comparison
for the machine it runs on).

Inference: packing a weight into oneDNN's blocked layout costs one pass over it, so it pays where a
weight serves many products with unchanged values, above all the steps of a decoding. Packing happens
only inside ``packed_inference()`` (greedy and beam search enter it), where oneDNN is chosen (the
rule below): there the weights cannot change, and the packed copies are dropped when it ends.
Attention's q, k and v (cross-attention's k and v) are one product there, and in training too
(``linears``), whichever library computes it.

Training (``train.cpu_gemm``, set once per process with ``set_cpu_gemm``): on a CPU the three products
of a linear layer -- the forward x W^T, the input gradient g W and the weight gradient g^T x -- run in
``_CpuLinear`` where a rule on the processor (``cpu_rules``) says PyTorch's own kernels are slower:

- fp32 through oneDNN where it beats MKL. Nothing is packed: the weights change every step, and a
  packed copy made per step measured no faster than oneDNN's plain call;
- bf16 autocast widened to fp32 where oneDNN has no bf16 kernels (no AVX-512): PyTorch then multiplies
  bf16 matrices with a scalar fallback (2-30 GFLOP/s against about 80 in fp32 per core here, and far
  slower for some transpositions); rounding the operands to bf16 and multiplying in fp32 gives the
  products of a bf16 GEMM with fp32 accumulation at the fp32 rate.

A rule, not a timing: every process of a run (and a resumed run) makes the same choice and computes
the same bits. ``auto`` follows the rules, ``onednn`` forces oneDNN for fp32 products, ``default``
keeps PyTorch's kernels; where ``$TPE_CPU_GEMM`` is ``onednn`` or ``default``, ``auto`` means that
mode (the tests run under each: docs/testing.md). GPUs, other dtypes, small products and
``torch.compile`` (which traces ``F.linear``) always take ``F.linear``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_ONEDNN = (
    torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
)


class _Scope(threading.local):
    depth = 0
    packed: dict[int, tuple[Tensor, Tensor]]  # id(weight) -> (weight, packed weight)
    fused: dict[tuple[int, ...], tuple[list[Linear], Tensor, Tensor | None]]  # stacked weights

    def __init__(self) -> None:
        self.packed = {}
        self.fused = {}


_SCOPE = _Scope()


@contextlib.contextmanager
def packed_inference() -> Iterator[None]:
    """Within this block the weights do not change: linear layers may pack their weights once."""
    _SCOPE.depth += 1
    try:
        with torch.no_grad():
            yield
    finally:
        _SCOPE.depth -= 1
        if _SCOPE.depth == 0:
            _SCOPE.packed.clear()
            _SCOPE.fused.clear()


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``; on a CPU, inside ``packed_inference`` in fp32 through oneDNN with
    the weight packed on first use where oneDNN is chosen (``onednn_chosen``), elsewhere through
    ``_CpuLinear`` where ``train.cpu_gemm`` and the processor's rules choose other kernels than
    PyTorch's (``_cpu_plan``)."""
    if not _packable(x, weight):
        plan = _cpu_plan(x, weight)
        if plan is not None:
            return _CpuLinear.apply(x, weight, bias, *plan)
        return F.linear(x, weight, bias)
    if not (_ONEDNN and onednn_chosen()):
        return F.linear(x, weight, bias)
    entry = _SCOPE.packed.get(id(weight))
    if entry is None or entry[0] is not weight:
        entry = (weight, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 256))
        _SCOPE.packed[id(weight)] = entry
    return torch.ops.mkldnn._linear_pointwise(x, entry[1], bias, "none", [], "")


def linears(x: Tensor, layers: Sequence[nn.Module], fuse: bool = True) -> list[Tensor]:
    """``[layer(x) for layer in layers]`` as one product when they are all ``Linear`` (self-attention's
    q, k, v: one GEMM of width 3 d instead of three of width d), its outputs returned as column views.

    Inside ``packed_inference`` on a CPU the stacked weight is built once (and packed where oneDNN is
    chosen). Elsewhere (training, ``fuse``) the weights are concatenated at every call, inside the
    autograd graph: the copy is 3 d^2 values against the 3 x tokens x d of the inputs that one
    product reads once instead of three times, and the backward computes one input gradient (one
    GEMM of depth 3 d, no sum of three). Under bf16 autocast the input is also rounded once, not three
    times. ``fuse=False`` keeps one product per layer (ZeRO-3 gathers a layer's weight only while that
    layer's own forward runs)."""
    plain = [layer for layer in layers if isinstance(layer, Linear)]
    if len(plain) != len(layers) or len(plain) < 2:
        return [layer(x) for layer in layers]
    widths = [layer.weight.shape[0] for layer in plain]
    if _packable(x, plain[0].weight):
        key = tuple(id(layer.weight) for layer in plain)
        entry = _SCOPE.fused.get(key)
        if entry is None:
            stacked = _stacked(plain, detach=True)
            if stacked is None:
                return [layer(x) for layer in layers]
            entry = (plain, *stacked)
            _SCOPE.fused[key] = entry
        return list(linear(x, entry[1], entry[2]).split(widths, dim=-1))
    stacked = _stacked(plain, detach=False) if fuse else None
    if stacked is None:
        return [layer(x) for layer in layers]
    return list(linear(x, *stacked).split(widths, dim=-1))


def _stacked(layers: Sequence[Linear], detach: bool) -> tuple[Tensor, Tensor | None] | None:
    """The layers' weights (and biases) concatenated along the output features; None where they
    cannot share one product (different inputs, dtypes or devices, a bias on some only, or a weight
    without values: a ZeRO-3 placeholder)."""
    weights = [layer.weight.detach() if detach else layer.weight for layer in layers]
    first = weights[0]
    if any(
        w.dim() != 2 or w.numel() == 0 or w.shape[1] != first.shape[1] or w.dtype != first.dtype
        or w.device != first.device
        for w in weights
    ):  # fmt: skip
        return None
    biases = [layer.bias for layer in layers]
    present = [(b.detach() if detach else b) for b in biases if b is not None]
    if len(present) not in (0, len(biases)):
        return None
    return torch.cat(weights), torch.cat(present) if present else None


def _packable(x: Tensor, weight: Tensor) -> bool:
    """Inside ``packed_inference``, on a CPU, in fp32: weights that cannot change, packed or stacked."""
    return (
        _SCOPE.depth > 0
        and not torch.is_grad_enabled()
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.numel() > 0  # a ZeRO-3 placeholder outside a gathered context has no values
        and not torch.is_autocast_enabled("cpu")
    )


#: ``train.cpu_gemm`` values: ``auto`` (each rule below where it holds), ``onednn`` (fp32 products of
#: any size always through oneDNN; bf16 as auto), ``default`` (PyTorch's own kernels for everything).
CPU_GEMM_MODES = ("auto", "onednn", "default")

#: Where set (``onednn`` or ``default``), ``auto`` means that mode in every process that reads it: the
#: test suite runs under each to show that no assertion depends on the kernels a processor picks.
CPU_GEMM_ENV = "TPE_CPU_GEMM"

#: Under ``auto``, products smaller than this many multiply-adds stay with ``F.linear``: the extra
#: setup of a oneDNN call or of widening only pays on large products.
_MIN_MACS = 1 << 20


def forced_cpu_gemm() -> str | None:
    """``$TPE_CPU_GEMM`` (``onednn`` or ``default``), the mode that replaces ``auto``; None where unset."""
    value = os.environ.get(CPU_GEMM_ENV, "")
    if value and value not in CPU_GEMM_MODES[1:]:
        raise ValueError(
            f"{CPU_GEMM_ENV}={value!r} is not one of {CPU_GEMM_MODES[1:]}: set it to one of them to force "
            "the CPU training GEMMs' kernels where train.cpu_gemm is auto, or unset it"
        )
    return value or None


class _Gemm:
    mode: str | None = None  # process-wide, as torch.backends flags are: set once at start-up
    rules: tuple[bool, bool] | None = None  # (onednn_faster, bf16_widens) for this processor


_GEMM = _Gemm()


def set_cpu_gemm(mode: str) -> None:
    """Choose the kernels of training GEMMs on the CPU for this process (``CPU_GEMM_MODES``)."""
    if mode not in CPU_GEMM_MODES:
        raise ValueError(f"cpu_gemm must be one of {CPU_GEMM_MODES}, not {mode!r}")
    _GEMM.mode = (forced_cpu_gemm() or mode) if mode == "auto" else mode


def _mode() -> str:
    """The mode set for this process; ``auto`` (or ``$TPE_CPU_GEMM``) where none was set."""
    if _GEMM.mode is None:
        set_cpu_gemm("auto")
    assert _GEMM.mode is not None
    return _GEMM.mode


def cpu_rules() -> tuple[bool, bool]:
    """This processor's answers, computed once: (oneDNN beats PyTorch's default fp32 GEMM, bf16
    products are faster widened to fp32).

    - oneDNN over MKL in fp32: on processors with AVX-512 that are not Intel's (MKL runs its AVX-512
      kernels only on Intel processors); elsewhere both run the same instruction set.
    - bf16 widened: where oneDNN has no bf16 kernels (no AVX-512: ``_is_mkldnn_bf16_supported``),
      PyTorch multiplies bf16 matrices with a scalar fallback, 10-100x slower than fp32 here.
    """
    if _GEMM.rules is None:
        avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
        _GEMM.rules = (
            _ONEDNN and avx512 and _cpu_vendor() not in ("GenuineIntel", ""),
            _ONEDNN and not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        )
    return _GEMM.rules


def onednn_chosen() -> bool:
    """Whether fp32 products on this CPU go to oneDNN: ``train.cpu_gemm=onednn``, or ``auto`` where
    the rule says oneDNN is faster."""
    mode = _mode()
    return mode == "onednn" or (mode == "auto" and cpu_rules()[0])


def _cpu_vendor() -> str:
    """``vendor_id`` of /proc/cpuinfo (Linux); empty where unknown."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_plan(x: Tensor, weight: Tensor) -> tuple[bool, bool] | None:
    """(through oneDNN, widened from bf16) for ``linear`` on these operands; None: ``F.linear``."""
    mode = _mode()
    forced = mode == "onednn"
    if (
        mode == "default"
        or x.device.type != "cpu"
        or weight.dim() != 2
        or x.dim() < 2
        or (x.numel() * weight.shape[0] < _MIN_MACS and not forced)
        or torch.compiler.is_compiling()
    ):
        return None
    onednn, widens = _ONEDNN and onednn_chosen(), cpu_rules()[1]
    if torch.is_autocast_enabled("cpu"):  # autocast rounds x and the fp32 weight to its dtype
        bf16 = torch.get_autocast_dtype("cpu") == torch.bfloat16 and weight.dtype == torch.float32
        return (onednn, True) if widens and bf16 and x.dtype in _WIDENABLE else None
    if x.dtype == weight.dtype == torch.bfloat16:  # bf16 weights (DeepSpeed's bf16)
        return (onednn, True) if widens else None
    return (True, False) if onednn and x.dtype == weight.dtype == torch.float32 else None


_WIDENABLE = (torch.float32, torch.bfloat16)


def _mm_t(a: Tensor, b: Tensor, onednn: bool) -> Tensor:
    """a @ b^T; a: (M, K), b: (N, K), either may be strided; oneDNN's inner product or MKL's GEMM."""
    if onednn:
        return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
    return torch.mm(a, b.t())


def weight_grad(g: Tensor, x: Tensor, onednn: bool) -> Tensor:
    """g^T x, the weight gradient (N, K) of a linear layer, from g (M, N) and x (M, K), M tokens.

    Both operands of this product are transposed, and oneDNN's inner product ran it far faster with
    the smaller of the two as its source (the operand whose rows become the output's rows; likely
    because it reorders a transposed source into its own layout first). So where the layer widens
    (N > K: the output layer, q/k/v, the FFN's first layer) the product is computed as (x^T g)^T and
    copied into the weight's (N, K) layout (docs/cpu-kernels.md#the-weight-gradient); where N <= K the
    source already is the smaller operand."""
    if onednn and g.shape[1] > x.shape[1]:
        return _mm_t(x.t(), g.t(), True).t().contiguous()
    return _mm_t(g.t(), x.t(), onednn)


class _CpuLinear(torch.autograd.Function):
    """``F.linear`` with chosen kernels for the forward and both backward products.

    ``onednn``: every product through oneDNN, else MKL's. ``widen`` (bf16 autocast, or bf16 weights):
    the operands are rounded to bf16 as autocast rounds them, then multiplied in fp32 -- the same
    products as a bf16 GEMM with fp32 accumulation (a product of two bf16 numbers is exact in fp32) --
    and the output rounded to bf16; the gradients of fp32 weights and biases stay fp32 (autocast would
    round them to bf16 first), those of bf16 ones are rounded. Only bf16 copies of the input are kept
    for the backward. The weight is read as it is at each call and saved as the parameter itself, so
    that under ZeRO-3 the backward reads the re-gathered weight, as DeepSpeed's own linear does."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, onednn: bool, widen: bool
    ) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # (M, K)
        with torch.autocast("cpu", enabled=False):
            if widen:
                x2 = x2.to(torch.bfloat16)
                w, b = _widened(weight), _widened(bias) if bias is not None else None
                out = _mm_t(x2.float(), w, onednn)
                out = (out if b is None else out.add_(b)).to(torch.bfloat16)
            elif onednn:
                out = torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")
            else:
                out = F.linear(x2, weight, bias)
        ctx.save_for_backward(x2, weight)
        ctx.x_shape, ctx.x_dtype, ctx.has_bias = x.shape, x.dtype, bias is not None
        ctx.onednn, ctx.widen = onednn, widen
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x2, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])  # (M, N)
        g2 = g2.float() if ctx.widen else g2.contiguous()
        w = _widened(weight) if ctx.widen else weight
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _mm_t(g2, w.t(), ctx.onednn).to(ctx.x_dtype).view(ctx.x_shape)  # g W: (M, K)
        if ctx.needs_input_grad[1]:
            x = x2.float() if ctx.widen else x2
            grad_w = weight_grad(g2, x, ctx.onednn).to(weight.dtype)  # g^T x: (N, K)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_b, None, None


def _widened(t: Tensor) -> Tensor:
    """``t`` rounded to bf16 (as autocast rounds a weight), back in fp32."""
    return t.detach().to(torch.bfloat16).float()


class Linear(nn.Linear):
    """``nn.Linear`` that takes ``linear`` (oneDNN with a packed weight inside ``packed_inference``,
    oneDNN for training GEMMs where ``train.cpu_gemm`` chooses it)."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
