"""The training linear of model/kernels.py: oneDNN (fp32) and widened bf16 products against F.linear.

"Within fp32 rounding" is the classical bound of a sum of n products computed in any order:
|fl(sum) - sum| <= gamma_n * sum of |terms|, gamma_n = n u / (1 - n u), u = 2^-24, checked element by
element against a float64 reference.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from support.batches import reversal_batches
from torch import Tensor

from tpe_train.config import ConfigError, load_config
from tpe_train.data.batching import Batch
from tpe_train.model import kernels
from tpe_train.model.args import ModelArgs
from tpe_train.model.transformer import Transformer
from tpe_train.parallel.context import ParallelContext
from tpe_train.parallel.engine import Engine
from tpe_train.train.cpu_setup import configure_cpu
from tpe_train.train.step import train_step

PRESETS = [
    "demo",
    "multi30k_en_de",
    "multi30k_en_de_cpu",
    "wmt14_en_de_base",
    "wmt14_en_de_big",
    "wmt14_en_fr_big",
]
U32 = 2.0**-24


def preset_shapes() -> list[tuple[int, int]]:
    """(in, out) of every linear layer of every preset: attention, both FFN products, the output layer."""
    shapes = set()
    for name in PRESETS:
        cfg = load_config(name, [])
        d, f, v = cfg.model.d_model, cfg.model.ffn_dim, cfg.data.vocab_size
        shapes |= {(d, d), (d, f), (f, d), (d, v)}
    return sorted(shapes)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Small products gain nothing from a second thread, and on a busy machine lose much to it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def cpu_gemm() -> Iterator[None]:
    yield
    kernels.set_cpu_gemm("auto")  # the process-wide setting back to the default


def gamma(n: int) -> float:
    return n * U32 / (1 - n * U32)


def assert_within_rounding(got: Tensor, exact: Tensor, magnitude: Tensor, terms: int, what: str) -> None:
    """|got - exact| <= gamma_terms * magnitude, element-wise (exact, magnitude: float64)."""
    err = (got.double() - exact).abs()
    bound = gamma(terms) * magnitude
    assert bool((err <= bound).all()), f"{what}: error {float((err - bound).max()):.3g} above the bound"


class Exact:
    """x W^T + b and its gradients for upstream g in float64, with the magnitudes that bound their
    rounding errors. Every element costs float64 work, so of the outputs of an output layer (and the
    rows of its weight gradient) evenly spaced ones, about 2,000 of the vocabulary's 37,000, are
    checked; the input gradient, a sum over all of them, is checked whole."""

    def __init__(self, w: Tensor) -> None:
        n = w.shape[0]
        self.rows = slice(None, None, max(1, n // 2048))
        self.w64 = w.double()
        self.w_abs = self.w64.abs()
        self.w_rows, self.w_rows_abs = self.w64[self.rows], self.w_abs[self.rows]

    def check(self, x: Tensor, b: Tensor | None, out: Tensor | None, grads: tuple, g: Tensor) -> None:
        """``out`` (unless None) and the gradients of (x, W, b), all within fp32 rounding."""
        x64, g64 = x.double().reshape(-1, x.shape[-1]), g.double().reshape(-1, g.shape[-1])
        (n, k), m, rows = self.w64.shape, x64.shape[0], self.rows
        if out is not None:
            assert out.shape == (*x.shape[:-1], n)
            exact, magnitude = x64 @ self.w_rows.T, x64.abs() @ self.w_rows_abs.T
            if b is not None:
                exact, magnitude = exact + b.double()[rows], magnitude + b.double()[rows].abs()
            assert_within_rounding(out.reshape(m, n)[:, rows], exact, magnitude, k + 1, "output")
        gx, gw, gb = grads
        assert gx.shape == x.shape and gw.shape == (n, k)
        assert_within_rounding(gx.reshape(m, k), g64 @ self.w64, g64.abs() @ self.w_abs, n, "input gradient")
        g_rows = g64[:, rows]
        assert_within_rounding(gw[rows], g_rows.T @ x64, g_rows.abs().T @ x64.abs(), m, "weight gradient")
        if b is not None:
            assert_within_rounding(gb, g64.sum(0), g64.abs().sum(0), m, "bias gradient")
        else:
            assert gb is None


def run_linear(fn, x: Tensor, w: Tensor, b: Tensor | None, g: Tensor) -> tuple[Tensor, tuple]:  # type: ignore[no-untyped-def]
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, w, b)]
    out = fn(*leaves)
    out.backward(g)
    return out.detach(), tuple(t.grad if t is not None else None for t in leaves)


@pytest.mark.slow
def test_onednn_linear_is_f_linear_within_rounding_on_every_preset_shape(cpu_gemm: None) -> None:
    kernels.set_cpu_gemm("onednn")
    gen = torch.Generator().manual_seed(0)
    for k, n in preset_shapes():
        w = torch.empty(n, k).uniform_(-(k**-0.5), k**-0.5, generator=gen)
        exact = Exact(w)
        for b in [torch.randn(n, generator=gen), None]:
            for batch in [(7,), (2, 5)]:  # 2-D and 3-D inputs; small batch dimensions keep it fast
                x = torch.randn(*batch, k, generator=gen)
                g = torch.randn(*batch, n, generator=gen)
                exact.check(x, b, *run_linear(kernels.linear, x, w, b, g), g)
                if n * k <= 1 << 22:  # the bound holds for PyTorch's own kernel too
                    exact.check(x, b, *run_linear(F.linear, x, w, b, g), g)
        y = kernels.linear(x, w.requires_grad_(), b)
        assert type(y.grad_fn).__name__ == "_CpuLinearBackward", (k, n)


def test_the_switch_and_its_exceptions(cpu_gemm: None) -> None:
    x, w = torch.randn(64, 40, 128), torch.randn(256, 128, requires_grad=True)
    kernels.set_cpu_gemm("default")
    assert type(kernels.linear(x, w).grad_fn).__name__ != "_CpuLinearBackward"
    kernels.set_cpu_gemm("onednn")
    assert type(kernels.linear(x, w).grad_fn).__name__ == "_CpuLinearBackward"
    assert type(kernels.linear(x.double(), w.double()).grad_fn).__name__ != "_CpuLinearBackward"
    # torch.compile traces F.linear: the training linear steps aside and the graph stays whole.
    compiled = torch.compile(kernels.linear, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, w), F.linear(x, w))
    with pytest.raises(ValueError, match="cpu_gemm"):
        kernels.set_cpu_gemm("fast")
    with pytest.raises(ConfigError, match="cpu_gemm"):
        load_config("demo", ["train.cpu_gemm=fast"])


def test_tpe_cpu_gemm_sets_what_auto_means(cpu_gemm: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """``$TPE_CPU_GEMM`` (how the suite runs under each kernel choice) replaces ``auto`` only: the
    products go where that mode sends them, whatever the processor's rule; an explicit mode stays."""
    x, w = torch.randn(64, 40, 128), torch.randn(256, 128, requires_grad=True)
    monkeypatch.setenv(kernels.CPU_GEMM_ENV, "onednn")
    kernels.set_cpu_gemm("auto")
    assert kernels.onednn_chosen() and type(kernels.linear(x, w).grad_fn).__name__ == "_CpuLinearBackward"
    kernels.set_cpu_gemm("default")
    assert not kernels.onednn_chosen()
    monkeypatch.setenv(kernels.CPU_GEMM_ENV, "default")
    kernels.set_cpu_gemm("auto")
    assert not kernels.onednn_chosen() and type(kernels.linear(x, w).grad_fn).__name__ != "_CpuLinearBackward"
    kernels.set_cpu_gemm("onednn")
    assert kernels.onednn_chosen()
    monkeypatch.setenv(kernels.CPU_GEMM_ENV, "fast")
    with pytest.raises(ValueError, match="TPE_CPU_GEMM='fast' is not one of"):
        kernels.set_cpu_gemm("auto")
    with pytest.raises(ConfigError, match="TPE_CPU_GEMM='fast'"):  # the trainer's start-up: exit status 2
        configure_cpu("auto", torch.device("cpu"))
    monkeypatch.delenv(kernels.CPU_GEMM_ENV)


@pytest.mark.parametrize("onednn", [False, True])
def test_widened_bf16_linear_multiplies_the_bf16_rounded_operands(onednn: bool) -> None:
    """Under bf16 autocast: the products of the bf16-rounded input and weight, fp32 accumulation, the
    output rounded to bf16 -- what a bf16 GEMM computes -- and fp32 weight and bias gradients."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 11, 256, generator=gen), torch.randn(1024, 256, generator=gen) / 16
    b, g = torch.randn(1024, generator=gen), torch.randn(3, 11, 1024, generator=gen).bfloat16()

    def widened(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return kernels._CpuLinear.apply(x, w, b, onednn, True)

    out, (gx, gw, gb) = run_linear(widened, x, w, b, g)
    assert out.dtype == torch.bfloat16 and gx.dtype == gw.dtype == gb.dtype == torch.float32
    xr, wr, br = (t.bfloat16().float() for t in (x, w, b))
    exact, magnitude = xr.double() @ wr.double().T + br.double(), xr.double().abs() @ wr.double().abs().T
    # fp32 rounding of the sum, then one bf16 rounding (relative 2^-9) of the result
    bound = gamma(257) * (magnitude + br.double().abs()) + 2.0**-8 * exact.abs()
    assert bool(((out.double() - exact).abs() <= bound).all())
    Exact(wr).check(xr, br, None, (gx, gw, gb), g.float())


def tiny_batches(n: int) -> list[Batch]:
    return reversal_batches(n, torch.Generator().manual_seed(3), rows=6, vocab=64, lengths=(4, 14))


def losses_of_20_steps(cpu_gemm: str, bf16: bool = False) -> list[float]:
    """20 AdamW steps of a small model with dropout, as the trainer takes them."""
    kernels.set_cpu_gemm(cpu_gemm)
    cfg = load_config("demo", ["train.clip_norm=1.0", f"train.cpu_gemm={cpu_gemm}"])
    torch.manual_seed(0)
    args = ModelArgs(vocab_size=64, d_model=64, n_heads=4, ffn_dim=128, encoder_layers=2, decoder_layers=2)
    model = Transformer(args).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ctx = ParallelContext.fake()
    engine = Engine(model, opt, sched, ctx, accumulate=1, clip_norm=1.0, deepspeed=None)
    return [
        train_step(engine, [b], cfg, ctx, amp_dtype=torch.bfloat16 if bf16 else None).read(ctx)["loss"]
        for b in tiny_batches(20)
    ]


def test_20_training_steps_through_onednn_give_the_losses_of_pytorchs_kernels(cpu_gemm: None) -> None:
    default, onednn = losses_of_20_steps("default"), losses_of_20_steps("onednn")
    assert default[-1] < default[0] - 0.3  # it trains, so the comparison can fail
    for a, b in zip(onednn, default, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (onednn, default)


def test_20_bf16_steps_widened_follow_pytorchs_bf16_kernels(cpu_gemm: None) -> None:
    """The widened products are bf16 products: the run follows PyTorch's bf16 GEMMs within what bf16
    rounding of the gradients (which PyTorch's kernels do and the widened ones do not) makes of 20 steps."""
    kernels._GEMM.rules = (kernels.cpu_rules()[0], True)  # widen on any processor, for this test
    try:
        widened = losses_of_20_steps("onednn", bf16=True)  # onednn: every product, however small
        native = losses_of_20_steps("default", bf16=True)
    finally:
        kernels._GEMM.rules = None
    assert native[-1] < native[0] - 0.3
    for a, b in zip(widened, native, strict=True):
        assert abs(a - b) <= 1e-2 * abs(b), (widened, native)


def test_model_flops_and_a_measured_peak() -> None:
    from tpe_train.train import throughput as perf

    # The benchmark's shape (d 256, FFN 1024, 3 + 3 layers, vocabulary 8,000) at padded lengths 36 / 37:
    # encoder 3 x (8·36·256² + 4·36²·256 + 4·36·256·1024), ..., output 2·37·256·8000 (by hand).
    parts = perf.forward_flops(256, 1024, 3, 3, 8000, 36, 37)
    assert parts["encoder"] == 3 * (18_874_368 + 1_327_104 + 37_748_736)
    assert parts["output"] == 151_552_000
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total") == 565_697_536
    args = ModelArgs(vocab_size=8000, d_model=256, ffn_dim=1024, encoder_layers=3, decoder_layers=3)
    assert perf.train_flops(args, [(128, 36, 37), (2, 36, 37)]) == 3 * 130 * parts["total"]

    peak = perf.measure_peak(torch.float32, torch.device("cpu"), [(64, 32, 48)], reps=2)
    assert set(peak.kernels) == ({"torch", "onednn"} if kernels._ONEDNN else {"torch"})
    assert all(len(rates) == 2 for rates in peak.samples.values())
    assert peak.gflops() == max(g for row in peak.table().values() for g in row.values()) > 0


def test_the_peak_times_each_kernel_only_after_untimed_calls() -> None:
    """AMX runs a product's first calls after other work at about half its rate: those calls are
    made, and not timed, before the timed ones (``warm``)."""
    from tpe_train.train import throughput as perf

    calls: list[float] = []
    peak = perf.Peak(torch.float32, torch.device("cpu"), {"counted": torch.nn.functional.linear}, [(8, 4, 6)])
    peak.kernels["counted"] = lambda a, b: calls.append(0.0)  # after the constructor's first call
    peak.sample(reps=3, warm=2)
    assert len(calls) == 5 and len(peak.samples[("8x4@4x6", "counted")]) == 3
    peak.sample(reps=1, warm=0)
    assert len(calls) == 6 and len(peak.samples[("8x4@4x6", "counted")]) == 4


def test_a_peak_measured_while_the_cores_were_busy_is_measured_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that measured its GEMM peak while another process had the cores (two study runs starting
    together) would report MFU above one: the meter measures again, and never reports above one."""
    from tpe_train.data.batching import Batch
    from tpe_train.train import throughput as perf

    rates = iter([1.0, 2.0])  # GFLOP/s: start-up (busy cores), then the second measurement
    monkeypatch.setattr(perf.Peak, "gflops", lambda self, statistic=max: next(rates))
    monkeypatch.setattr(perf.Peak, "sample", lambda self, reps=1: None)
    args = ModelArgs(vocab_size=100, d_model=32, ffn_dim=64, encoder_layers=1, decoder_layers=1)
    meter = perf.Throughput(args, torch.float32, torch.device("cpu"))
    assert meter.peak == 1.0
    src, tgt = torch.full((8, 10), 5), torch.full((8, 11), 5)
    batch = Batch(ids=torch.arange(8), src=src, tgt_in=tgt, tgt_out=tgt)
    meter.step([batch])  # about 0.4 GFLOP of model work, read back within a second
    out = meter.read(80.0)
    assert meter.peak >= 2.0 and 0 < out["train/mfu"] <= 1.0, (meter.peak, out)
    given = perf.Throughput(args, torch.float32, torch.device("cpu"), peak_gflops=0.001)  # the user's figure
    given.step([batch])
    assert given.read(80.0)["train/mfu"] > 1.0 and given.peak == 0.001  # kept as given, not measured
