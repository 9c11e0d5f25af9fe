"""Attention backends at the WMT presets' shapes: every encoding, each backend, eager and compiled.

Run from the repository root; the numbers are only comparable *within one run*::

    python benchmarks/bench_attention.py --preset wmt14_en_de_base                   # CPU, fp32
    python benchmarks/bench_attention.py --preset wmt14_en_de_big --max-tokens 1000 --backends sdpa \\
        --compile-backends none --steps 2                                            # CPU, sized down
    python benchmarks/bench_attention.py --preset wmt14_en_de_big --device cuda --bf16   # one GPU
    python benchmarks/bench_attention.py --preset wmt14_en_de_base --decode-only       # beam search

Shape: the preset's model (base: d_model 512, 8 heads, FFN 2048, 6 + 6 layers; big: 1024, 16, 4096)
over the preset's joint vocabulary (37,000). Batches have the lengths of real text: a joint BPE of the
preset's vocabulary size (capped by what the text allows) is trained on the 10,000 WMT training pairs
of ``opennmt-toy-ende`` and applied to newstest2014 (3,003 held-out pairs); those lengths are cut into
token batches of ``--max-tokens`` padded source + target tokens (the preset's ``data.max_tokens``
unless given) exactly as training cuts them (``token_batches``: sorted by length, so padding stays
small), and ``--batches`` of them are taken at evenly spaced quantiles of their padded size, short to
long. Token ids are random (fixed seed); every row sees the same batches in the same order.

Rows are grouped by encoding: each group holds ``none`` and one encoding (one model each, shared by
that model's rows) and interleaves their rows round-robin: every backend of ``--backends``, eager,
and every backend of ``--compile-backends`` with ``train.compile``'s regional compilation (the first,
untimed steps pay the compilation). Steps are forward + label-smoothed loss + backward + Adam, fp32
(or bf16 autocast with ``--bf16``), dropout as in the preset. Printed per row: target tokens/s, the
median step, the step against ``none``'s row with the same backend and compilation in the same
group, the step's memory (GPU: peak allocated; CPU: bytes of the tensors autograd saves for the
backward pass, where the backends differ, as the CPU allocator keeps no peak), model FLOP/s and MFU
against the matmul peak measured in the same rounds on the model's own GEMM shapes (FLOP formula and
peak: ``tpe_train/perf.py``, the best of PyTorch's and oneDNN's kernels). ``flex`` cannot train on
the CPU (no backward there in torch 2.13):
its rows are left out there and beam search compares it instead.

Beam search (``--decode``): beam 4, alpha 0.6, KV cache, eval mode, a batch of ``--decode-batch``
sentences from the middle of the length distribution, exactly ``--decode-steps`` decoder steps per
sentence (EOS suppressed before, as ``bench_train.py`` does), each backend of ``--decode-backends``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:  # run as a script from a checkout without installing the package
        sys.path.insert(0, str(path))

import bench_train  # noqa: E402  (Hugging Face peers, attention names, early-EOS suppression)

from tpe_train.config import load_config  # noqa: E402
from tpe_train.data.batching import token_batches  # noqa: E402
from tpe_train.data.tokenizer import train_tokenizer  # noqa: E402
from tpe_train.model.args import ModelArgs  # noqa: E402
from tpe_train.model.attention import Attention  # noqa: E402
from tpe_train.model.generate import beam_search  # noqa: E402
from tpe_train.model.loss import label_smoothed_loss  # noqa: E402
from tpe_train.model.transformer import Transformer  # noqa: E402
from tpe_train.positions import POSITIONS, PositionArgs  # noqa: E402
from tpe_train.train import throughput as perf  # noqa: E402

PAD, BOS, EOS, FIRST_ID = 0, 1, 2, 4
DATA = ROOT.parent / "shared" / "data"


@dataclass
class Batch:
    src: Tensor  # (B, Ls) right-padded
    tgt_in: Tensor  # (B, Lt) BOS + target
    tgt_out: Tensor  # (B, Lt) target + EOS
    ntok: int  # non-pad target tokens


# ---------------------------------------------------------------------------------------- data


def real_lengths(data: Path, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(source, target) token counts + EOS of newstest2014 under a joint BPE trained on WMT pairs."""
    toy, news = data / "opennmt-toy-ende", data / "newstest2014-en-de"
    for f in (toy / "src-train.txt", news / "newstest2014.en"):
        if not f.is_file():
            raise SystemExit(f"bench_attention: {f} not found; pass --data with the shared data folder")

    def lines(path: Path) -> list[str]:
        return [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]

    tok = train_tokenizer(lines(toy / "src-train.txt") + lines(toy / "tgt-train.txt"), vocab)
    src, tgt = lines(news / "newstest2014.en"), lines(news / "newstest2014.de")
    src_len = np.array([len(e.ids) + 1 for e in tok.encode_batch(src)])
    tgt_len = np.array([len(e.ids) + 1 for e in tok.encode_batch(tgt)])
    return src_len, tgt_len


def make_batches(
    src_len: np.ndarray, tgt_len: np.ndarray, max_tokens: int, n: int, vocab: int, device: torch.device
) -> list[Batch]:
    """``n`` token batches at evenly spaced quantiles of padded size, random ids, real lengths."""
    cut = token_batches(src_len, tgt_len, max_tokens, seed=1)
    cut.sort(key=lambda idx: int(src_len[idx].max() + tgt_len[idx].max()))
    picks = (
        [cut[round(q * (len(cut) - 1))] for q in np.linspace(0.1, 0.9, n)] if n > 1 else [cut[len(cut) // 2]]
    )
    gen = torch.Generator().manual_seed(1234)
    out = []
    for idx in picks:
        b, ls, lt = len(idx), int(src_len[idx].max()), int(tgt_len[idx].max())
        src = torch.full((b, ls), PAD, dtype=torch.long)
        tgt_in = torch.full((b, lt), PAD, dtype=torch.long)
        tgt_out = torch.full((b, lt), PAD, dtype=torch.long)
        for row, i in enumerate(idx):
            s, t = int(src_len[i]), int(tgt_len[i])
            src[row, : s - 1] = torch.randint(FIRST_ID, vocab, (s - 1,), generator=gen)
            src[row, s - 1] = EOS
            words = torch.randint(FIRST_ID, vocab, (t - 1,), generator=gen)
            tgt_in[row, 0], tgt_in[row, 1:t] = BOS, words
            tgt_out[row, : t - 1], tgt_out[row, t - 1] = words, EOS
        out.append(Batch(src.to(device), tgt_in.to(device), tgt_out.to(device), int((tgt_out != PAD).sum())))
    return out


# --------------------------------------------------------------------------------------- model


def build(preset: Any, kind: str, vocab: int, device: torch.device) -> Transformer:
    m = preset.model
    torch.manual_seed(1234)
    args = ModelArgs(
        vocab_size=vocab,
        pad_id=PAD,
        bos_id=BOS,
        eos_id=EOS,
        d_model=m.d_model,
        n_heads=m.n_heads,
        ffn_dim=m.ffn_dim,
        encoder_layers=m.encoder_layers,
        decoder_layers=m.decoder_layers,
        dropout=m.dropout,
        attention_dropout=m.attention_dropout,
        activation_dropout=m.activation_dropout,
        encoder_position=kind,
        decoder_position=kind,
        position=PositionArgs(
            d_model=m.d_model, n_heads=m.n_heads, causal=False, max_positions=m.position.max_positions
        ),
    )
    return Transformer(args).to(device)


def set_backend(model: nn.Module, backend: str) -> None:
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend = backend


def set_compiled(model: Transformer, compiled: dict[str, Any] | None) -> None:
    """Switch the model's stacks between their compiled layers and the eager ones."""
    for name in ("encoder", "decoder"):
        getattr(model, name).__dict__["_compiled"] = compiled[name] if compiled else None


@dataclass
class Shared:
    """One model of a group and its optimizer, shared by its rows (they only differ in how they run)."""

    model: Transformer
    opt: torch.optim.Optimizer
    compiled: dict[str, Any] | None = None

    def compile(self) -> dict[str, Any]:
        if self.compiled is None:
            set_compiled(self.model, None)
            self.model.compile_layers()
            self.compiled = {n: getattr(self.model, n).__dict__["_compiled"] for n in ("encoder", "decoder")}
        return self.compiled


@dataclass
class TrainRow:
    kind: str
    backend: str
    compiled: bool
    shared: Shared
    batches: list[Batch]
    device: torch.device
    bf16: bool
    epsilon: float
    times: list[float] = field(default_factory=list)
    memory: list[int] = field(default_factory=list)
    _step: int = 0

    @property
    def name(self) -> str:
        return f"{self.kind}/{self.backend}{'+compile' if self.compiled else ''}"

    def step(self) -> None:
        model, opt = self.shared.model, self.shared.opt
        set_backend(model, self.backend)
        set_compiled(model, self.shared.compile() if self.compiled else None)
        model.train()
        b = self.batches[self._step % len(self.batches)]
        self._step += 1
        opt.zero_grad(set_to_none=True)
        cast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()
        )
        saved: dict[int, int] = {}

        def pack(t: Tensor) -> Tensor:
            if t.device.type == "cpu":  # bytes autograd keeps for the backward, per storage
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with cast, hooks:
            logits = model(b.src, b.tgt_in)
            loss, _, ntok = label_smoothed_loss(logits, b.tgt_out, PAD, self.epsilon)
        (loss / ntok).backward()
        opt.step()
        if self.device.type == "cuda":
            self.memory.append(torch.cuda.max_memory_allocated(self.device))
        else:
            self.memory.append(sum(saved.values()))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


DTYPE: list[Any] = ["fp32", torch.float32]  # (name, dtype) of the peak: set in main
DEVICE_: list[torch.device] = [torch.device("cpu")]
PEAK_SHAPES_: list[list[tuple[int, int, int]]] = [[]]


class PeakRow:
    """The matmul peak (``perf.Peak``: the best of PyTorch's and oneDNN's kernels) as a row of the
    interleaved rounds, so that MFU's peak is measured under the same machine load as the steps.
    Its shapes are (M, K, N) products; ``perf.Peak`` takes them as (rows, inner, outer)."""

    name = "matmul-peak"

    def __init__(self, dtype_name: str, dtype: torch.dtype, device: torch.device, shapes: list[Any]) -> None:
        kernels = perf.gemm_kernels(dtype, device, native_bf16=False)
        self.dtype_name, self.times = dtype_name, []  # type: ignore[var-annotated]
        self.peak = perf.Peak(dtype, device, kernels, list(shapes))

    def step(self) -> None:
        self.peak.sample(2)

    def result(self) -> dict[str, Any]:
        per_shape = {shape: max(row.values()) for shape, row in self.peak.table(statistics.median).items()}
        return {self.dtype_name: {"per_shape_gflops": per_shape, "peak_gflops": max(per_shape.values())}}


def interleave(rows: list[Any], warmup: int, steps: int, device: torch.device, label: str) -> None:
    for row in rows:
        t0 = time.perf_counter()
        for _ in range(warmup):
            row.step()
        print(
            f"  [{label}] warmed up {row.name:<28} in {time.perf_counter() - t0:7.1f} s",
            file=sys.stderr,
            flush=True,
        )
    for r in range(steps):
        t_round = time.perf_counter()
        shift = r % len(rows)
        for row in rows[shift:] + rows[:shift]:
            gc.collect()
            sync(device)
            t0 = time.perf_counter()
            row.step()
            sync(device)
            row.times.append(time.perf_counter() - t0)
        print(
            f"  [{label}] round {r + 1}/{steps} in {time.perf_counter() - t_round:7.1f} s",
            file=sys.stderr,
            flush=True,
        )


# ------------------------------------------------------------------------------------ decoding


@dataclass
class DecodeRow:
    kind: str
    backend: str
    model: Transformer
    src: Tensor
    steps: int
    times: list[float] = field(default_factory=list)
    hyps: list[list[int]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.kind}/{self.backend}"

    def step(self) -> None:
        set_backend(self.model, self.backend)
        set_compiled(self.model, None)
        self.model.eval()
        self.hyps = beam_search(self.model, self.src, beam=4, alpha=0.6, max_len_a=0.0, max_len_b=self.steps)


# ---------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    kinds = POSITIONS.names()

    def names(s: str) -> list[str]:
        return [k.strip() for k in s.split(",") if k.strip() and k.strip() != "none"] if s != "none" else []

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--preset", default="wmt14_en_de_base", help="wmt14_en_de_base (default) or wmt14_en_de_big"
    )
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads on the CPU (default 2)")
    p.add_argument("--data", type=Path, default=DATA, help="the shared data folder (default ../shared/data)")
    p.add_argument(
        "--max-tokens", type=int, default=0, help="padded tokens per batch (default: the preset's)"
    )
    p.add_argument("--batches", type=int, default=3, help="distinct batches, cycled (default 3)")
    p.add_argument(
        "--kinds", type=names, default=[k for k in kinds if k != "none"], help="encodings besides none"
    )
    p.add_argument(
        "--backends", type=names, default=None, help="eager backends (default: sdpa,explicit[,flex on GPU])"
    )
    p.add_argument(
        "--compile-backends",
        type=names,
        default=None,
        help="compiled backends (default sdpa[,flex on GPU]; none: no compiled rows)",
    )
    p.add_argument(
        "--compile-kinds", type=names, default=None, help="encodings with compiled rows (default: all)"
    )
    p.add_argument(
        "--hf", action="store_true", help="also Hugging Face MarianMT, BART and T5 at the preset's shape"
    )
    p.add_argument("--steps", type=int, default=3, help="timed steps per row (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per row (default 1)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (default fp32)")
    p.add_argument("--no-train", action="store_true", help="skip the training rows")
    p.add_argument(
        "--decode", type=names, default=["t5", "alibi", "rope"], help="encodings for beam search (none: skip)"
    )
    p.add_argument("--decode-backends", type=names, default=["sdpa", "flex"], help="beam search backends")
    p.add_argument(
        "--decode-batch", type=int, default=16, help="sentences per beam-search batch (default 16)"
    )
    p.add_argument("--decode-steps", type=int, default=12, help="decoder steps per sentence (default 12)")
    p.add_argument(
        "--decode-rounds", type=int, default=2, help="timed beam-search batches per row (default 2)"
    )
    p.add_argument("--json", type=Path, help="write every number to this file")
    args = p.parse_args(argv)
    gpu = args.device.startswith("cuda")
    if args.backends is None:
        args.backends = ["flex", "sdpa", "explicit"] if gpu else ["sdpa", "explicit"]
    if args.compile_backends is None:
        args.compile_backends = ["flex", "sdpa"] if gpu else ["sdpa"]
    if not gpu:  # FlexAttention has no backward pass on the CPU
        args.backends = [b for b in args.backends if b != "flex"]
        args.compile_backends = [b for b in args.compile_backends if b != "flex"]
    unknown = [k for k in args.kinds + args.decode if k not in kinds]
    if unknown:
        p.error(f"unknown encoding(s) {unknown}; choose from {kinds}")
    return args


@dataclass
class HFRow:
    """A Hugging Face encoder-decoder of the preset's shape (random weights), trained as TrainRow is."""

    kind: str
    model: nn.Module
    batches: list[Batch]
    device: torch.device
    bf16: bool
    epsilon: float
    times: list[float] = field(default_factory=list)
    memory: list[int] = field(default_factory=list)
    backend: str = "hf"
    compiled: bool = False
    _step: int = 0

    def __post_init__(self) -> None:
        self.model.to(self.device).train()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)

    @property
    def name(self) -> str:
        return f"{self.kind}/{bench_train.attn_impl(self.model)}"

    def step(self) -> None:
        b = self.batches[self._step % len(self.batches)]
        self._step += 1
        self.opt.zero_grad(set_to_none=True)
        cast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()
        )
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        with cast:
            logits = self.model(
                input_ids=b.src,
                attention_mask=(b.src != PAD).long(),
                decoder_input_ids=b.tgt_in,
                use_cache=False,
            ).logits
            loss, _, ntok = label_smoothed_loss(logits, b.tgt_out, PAD, self.epsilon)
        (loss / ntok).backward()
        self.opt.step()
        self.memory.append(torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else 0)


def hf_group(
    args: argparse.Namespace, preset: Any, batches: list[Batch], vocab: int, device: torch.device
) -> tuple[list[Any], dict[str, Any]]:
    """tpe's sinusoidal, learned and t5 (eager, auto backend) against MarianMT, BART and T5."""
    m = preset.model
    bench_train.N_HEADS = m.n_heads
    eps = preset.train.label_smoothing
    rows: list[Any] = []
    for kind, hf in bench_train.HF_MATCH.items():
        model = build(preset, kind, vocab, device)
        shared = Shared(model, torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9))
        rows.append(TrainRow(kind, "auto", False, shared, batches, device, args.bf16, eps))
        rows.append(HFRow(hf, bench_train.hf_model(hf), batches, device, args.bf16, eps))
    sampler = PeakRow(DTYPE[0], DTYPE[1], DEVICE_[0], PEAK_SHAPES_[0])
    interleave([*rows, sampler], args.warmup, args.steps, device, "hf")
    return rows, sampler.result()


def train_group(
    args: argparse.Namespace, preset: Any, kind: str, batches: list[Batch], vocab: int, device: torch.device
) -> tuple[list[TrainRow], dict[str, Any]]:
    torch._dynamo.reset()
    rows: list[Any] = []
    for k in ("none", kind):
        model = build(preset, k, vocab, device)
        shared = Shared(model, torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9))
        eps = preset.train.label_smoothing
        for backend in args.backends:
            rows.append(TrainRow(k, backend, False, shared, batches, device, args.bf16, eps))
        if args.compile_kinds is None or kind in args.compile_kinds:
            for backend in args.compile_backends:
                rows.append(TrainRow(k, backend, True, shared, batches, device, args.bf16, eps))
    sampler = PeakRow(DTYPE[0], DTYPE[1], DEVICE_[0], PEAK_SHAPES_[0])
    interleave([*rows, sampler], args.warmup, args.steps, device, kind)
    return rows, sampler.result()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64  # several models, backends and compiled rows in one process
    torch._dynamo.config.accumulated_recompile_limit = 4096
    preset = load_config(args.preset)
    m, vocab = preset.model, preset.data.vocab_size
    max_tokens = args.max_tokens or preset.data.max_tokens
    started = time.perf_counter()
    env = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "loadavg_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    print(f"env: {env}")
    src_len, tgt_len = real_lengths(args.data, vocab)
    batches = make_batches(src_len, tgt_len, max_tokens, args.batches, vocab, device)
    print(
        f"\npreset {args.preset}: d_model {m.d_model}, {m.n_heads} heads, FFN {m.ffn_dim}, "
        f"{m.encoder_layers}+{m.decoder_layers} layers, vocab {vocab}, dropout {m.dropout}; "
        f"{'bf16 autocast' if args.bf16 else 'fp32'}; batches of <= {max_tokens} padded tokens"
    )
    print(
        f"newstest2014 under a {vocab}-entry BPE: source {np.mean(src_len):.1f} tokens on average "
        f"(median {np.median(src_len):.0f}, 95th percentile {np.percentile(src_len, 95):.0f}), "
        f"target {np.mean(tgt_len):.1f}"
    )
    for b in batches:
        real = int((b.src != PAD).sum() + (b.tgt_out != PAD).sum())
        padded = b.src.numel() + b.tgt_out.numel()
        print(
            f"  batch {tuple(b.src.shape)} src, {tuple(b.tgt_in.shape)} tgt: {b.ntok} target tokens, "
            f"{100 * (1 - real / padded):.0f}% padding"
        )
    # bench_train's Hugging Face models read their shape from module globals
    bench_train.D_MODEL, bench_train.FFN_DIM, bench_train.VOCAB = m.d_model, m.ffn_dim, vocab
    bench_train.LAYERS, bench_train.DEVICE = m.encoder_layers, device
    tokens = 4096
    DEVICE_[0] = device
    PEAK_SHAPES_[0] = [
        (tokens, m.d_model, m.ffn_dim),
        (tokens, m.ffn_dim, m.d_model),
        (tokens, m.d_model, m.d_model),
        (tokens, m.d_model, vocab),
    ]
    dtype = "bf16" if args.bf16 else "fp32"
    DTYPE[:] = [dtype, torch.bfloat16 if args.bf16 else torch.float32]
    L = m.encoder_layers
    flops = [
        3
        * b.src.shape[0]
        * perf.forward_flops(m.d_model, m.ffn_dim, L, m.decoder_layers, vocab, *lens)["total"]
        for b in batches
        for lens in [(b.src.shape[1], b.tgt_in.shape[1])]
    ]
    mean_tok = statistics.mean(b.ntok for b in batches)

    results: list[dict[str, Any]] = []
    peaks: list[float] = []
    gpu = device.type == "cuda"
    if not args.no_train:
        print(
            f"\ntraining step (fwd + loss + bwd + Adam), median of {args.steps} interleaved steps per row; "
            "vs none = step / none's step with the same backend and compilation, same group;\n"
            f"memory = {'peak allocated' if gpu else 'bytes autograd saved for the backward'}; "
            f"MFU = model FLOP/s / {dtype} matmul peak measured in the same rounds"
        )
        print(
            f"\n{'row':<28}{'tok/s':>9}{'step ms':>10}{'vs none':>9}{'memory MB':>11}{'GFLOP/s':>9}{'MFU':>7}"
        )
        for kind in args.kinds:
            rows, peak = train_group(args, preset, kind, batches, vocab, device)
            peaks.append(peak[dtype]["peak_gflops"])
            base = {(r.backend, r.compiled): statistics.median(r.times) for r in rows if r.kind == "none"}
            for r in rows:  # none's rows are measured again in every group: each compares with its own
                step = statistics.median(r.times)
                gflops = statistics.mean(flops) / step / 1e9
                res = {
                    "group": kind,
                    "row": r.name,
                    "kind": r.kind,
                    "backend": r.backend,
                    "compiled": r.compiled,
                    "tokens_per_s": mean_tok / step,
                    "step_ms": 1000 * step,
                    "step_ms_all": [1000 * t for t in r.times],
                    "vs_none": step / base[(r.backend, r.compiled)],
                    "memory_bytes": max(r.memory),
                    "model_gflops": gflops,
                    "mfu": gflops / peak[dtype]["peak_gflops"],
                    "peak_gflops": peak[dtype]["peak_gflops"],
                }
                results.append(res)
                print(
                    f"{r.name:<28}{res['tokens_per_s']:>9.0f}{res['step_ms']:>10.0f}{res['vs_none']:>9.2f}"
                    f"{res['memory_bytes'] / 2**20:>11.0f}{gflops:>9.1f}{100 * res['mfu']:>6.1f}%"
                )
            print(f"  ({dtype} matmul peak in these rounds: {peak[dtype]['peak_gflops']:.1f} GFLOP/s)")
            del rows
            gc.collect()

    hf_results: list[dict[str, Any]] = []
    if args.hf and not args.no_train:
        rows, peak = hf_group(args, preset, batches, vocab, device)
        print("\nagainst Hugging Face (eager; tpe: auto backend): vs HF = tokens/s / the matching HF model's")
        print(f"{'row':<28}{'tok/s':>9}{'step ms':>10}{'vs HF':>9}{'memory MB':>11}{'GFLOP/s':>9}{'MFU':>7}")
        for tpe, hf in zip(rows[0::2], rows[1::2], strict=True):
            for r in (tpe, hf):
                step = statistics.median(r.times)
                gflops = statistics.mean(flops) / step / 1e9
                res = {
                    "row": r.name,
                    "tokens_per_s": mean_tok / step,
                    "step_ms": 1000 * step,
                    "vs_hf": statistics.median(hf.times) / step,
                    "memory_bytes": max(r.memory),
                    "model_gflops": gflops,
                    "mfu": gflops / peak[dtype]["peak_gflops"],
                }
                hf_results.append(res)
                print(
                    f"{r.name:<28}{res['tokens_per_s']:>9.0f}{res['step_ms']:>10.0f}{res['vs_hf']:>9.2f}"
                    f"{res['memory_bytes'] / 2**20:>11.0f}{gflops:>9.1f}{100 * res['mfu']:>6.1f}%"
                )
        print(f"  ({dtype} matmul peak in these rounds: {peak[dtype]['peak_gflops']:.1f} GFLOP/s)")

    decode: list[dict[str, Any]] = []
    if args.decode:
        order = np.argsort(src_len)
        middle = order[len(order) // 2 - args.decode_batch // 2 :][: args.decode_batch]
        ls = int(src_len[middle].max())
        gen = torch.Generator().manual_seed(99)
        src = torch.full((len(middle), ls), PAD, dtype=torch.long)
        for row, i in enumerate(middle):
            n = int(src_len[i])
            src[row, : n - 1], src[row, n - 1] = torch.randint(FIRST_ID, vocab, (n - 1,), generator=gen), EOS
        src = src.to(device)
        drows = []
        for kind in args.decode:
            model = bench_train.suppress_early_eos(build(preset, kind, vocab, device), args.decode_steps - 1)
            drows += [DecodeRow(kind, b, model, src, args.decode_steps) for b in args.decode_backends]
        interleave(drows, 1, args.decode_rounds, device, "beam")
        print(
            f"\nbeam search: beam 4, {len(middle)} sentences (source {ls} tokens padded), exactly "
            f"{args.decode_steps} decoder steps each, fp32, median batch time; vs first = time / "
            f"{args.decode_backends[0]}'s"
        )
        print(f"{'row':<28}{'sent/s':>9}{'batch s':>9}{'vs first':>10}  same hypotheses")
        for kind in args.decode:
            mine = [r for r in drows if r.kind == kind]
            first = statistics.median(mine[0].times)
            for r in mine:
                t = statistics.median(r.times)
                same = r.hyps == mine[0].hyps
                decode.append(
                    {
                        "row": r.name,
                        "seconds": t,
                        "sentences_per_s": len(middle) / t,
                        "vs_first": t / first,
                        "same_hypotheses": same,
                    }
                )
                print(f"{r.name:<28}{len(middle) / t:>9.2f}{t:>9.2f}{t / first:>10.2f}  {same}")

    env["loadavg_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    elapsed = time.perf_counter() - started
    print(
        f"\nload average at start {env['loadavg_at_start']}, at end {env['loadavg_at_end']}; "
        f"total {elapsed:.0f} s"
    )
    if args.json:
        payload = {
            "env": env,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "batches": [
                {"src": list(b.src.shape), "tgt": list(b.tgt_in.shape), "target_tokens": b.ntok}
                for b in batches
            ],
            "train_flops_per_step": flops,
            "train": results,
            "hf": hf_results,
            "matmul_peaks_gflops": peaks,
            "decode": decode,
            "seconds": elapsed,
        }
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
