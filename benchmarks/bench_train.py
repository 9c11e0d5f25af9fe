"""Training-step and beam-search throughput of tpe_train's encodings against Hugging Face models.

Run from the repository root (CPU; the numbers are only comparable *within one run*)::

    python benchmarks/bench_train.py                     # everything: ~10 min on 2 idle cores
    python benchmarks/bench_train.py --steps 2 --warmup 1 --only none,rope --no-decode
    python benchmarks/bench_train.py --json bench.json   # also write every number
    python benchmarks/bench_train.py --device cuda       # on a GPU (timings synchronise the device)
    python benchmarks/bench_train.py --threads 1 --cpu-time   # one thread, timed by its CPU time: a
                                                         # busy machine's other processes not counted

Shape (one issue's): d_model 256, 4 heads, FFN 1024, 3 + 3 layers, one shared vocabulary of 8,000
with tied embeddings, dropout 0.1 (attention and activation dropout 0), batches of 128 sentences
whose source and target lengths are uniform in [24, 36] (target + EOS: ~31 tokens, ~4,000 target
tokens per batch), right-padded to 36 source / 37 target positions. Token ids are random (3..7999,
fixed seed) and every model sees the same batches in the same order.

What is measured
----------------
1. **Peak** (``tpe_train/perf.py``, the trainer's MFU uses the same code): GFLOP/s of every way the
   machine multiplies the model's own GEMM shapes ((4096x256)@(256x1024), (4096x1024)@(1024x256),
   (4096x256)@(256x256), (4096x256)@(256x8000)): PyTorch's kernel (MKL for fp32 on x86), oneDNN's,
   and for bf16 on a CPU the operands widened to fp32 (with either library). Per dtype, the peak is
   the best (shape, kernel) median. It is measured once at the start and again as one more row of
   the interleaved training rounds (3 timed repetitions per kernel and shape per round, each
   group after 2 untimed calls: AMX runs its first calls after other work at half its rate); MFU uses the
   latter, taken under the same machine load as the steps (where the CPU has no bf16 kernels,
   PyTorch's bf16 kernel is too slow to repeat there: its at-start rate enters the peak instead).
   A kernel table also prints each training product -- forward x W^T, input gradient g W, weight
   gradient g^T x -- through PyTorch's kernel and through oneDNN (fp32) or widened (bf16), and
   which one ``train.cpu_gemm=auto`` takes on this processor.
2. **Training step**: forward + label-smoothed loss (eps 0.1, ``label_smoothed_loss`` on the logits
   for *every* model, HF ones included, never HF's ``labels=``) + backward + Adam step (fused, as
   the trainer's AdamW without weight decay), dropout on,
   in fp32 and under ``torch.autocast("cpu", dtype=torch.bfloat16)`` around forward + loss (fp32
   master weights). Rows: every tpe_train encoding, plus Hugging Face models of the same shape built
   from a config with random weights: MarianMT (sinusoidal) <-> ``sinusoidal``, BART (learned
   absolute) <-> ``learned``, T5 (relative bucket bias) <-> ``t5``. All timed steps are interleaved
   round-robin over the rows (one step of each row per round, order rotated every round), so a
   load change on a shared machine hits all rows alike; the reported step time is the median.
   Columns: target tokens/s (mean non-pad target tokens per batch / median step time), step ms,
   ``vs HF`` = tokens/s of the row / tokens/s of its matching HF model (> 1: tpe_train faster),
   ``vs none`` = step time / step time of tpe ``none`` in the same dtype, MFU = model FLOP/s /
   the measured peak of the row's dtype. The process runs as the trainer does
   (``tpe_train.train.throughput.configure_cpu``: ``train.cpu_gemm``, allocator), HF rows included.
3. **Model FLOPs**: ``tpe_train.train.throughput.forward_flops`` (matmul FLOPs, 2 per multiply-add, training =
   3 x forward, padded lengths; formula in that module's docstring). Norms, softmax, the loss,
   position-encoding extras and the optimizer are not counted, so all models of this shape do the
   same "model FLOPs" and MFU is proportional to tokens/s.
4. **Decoding**: beam 4, length penalty 0.6, KV cache, a batch of 64 sources of length 24..36, fp32,
   eval mode. With random weights the models would stop at different, arbitrary lengths, so both
   sides are made to run exactly the same number of decoder steps, ``N + 1`` with N = 30:

   - tpe_train: ``beam_search(model, src, beam=4, alpha=0.6, max_len_a=0, max_len_b=N + 1)`` on a
     model whose ``decode`` sets the EOS logit to -inf during the first N steps (a per-instance
     wrapper, one in-place write into the (B*K, 1, V) logits per step: what HF's
     ``min_new_tokens`` logits processor does); step N + 1 is then forced to EOS by the length
     limit, so every hypothesis is N tokens + EOS after N + 1 decoder calls.
   - Hugging Face: ``generate(num_beams=4, length_penalty=0.6, min_new_tokens=N + 1,
     max_new_tokens=N + 1, suppress_tokens=[pad])``: EOS suppressed throughout, N + 1 decoder
     calls, N + 1 tokens (pad is suppressed as tpe_train's beam search does).

   Reported: sentences/s and decoded tokens/s (sentences x (N + 1) decoder steps, EOS counted), and
   the ratio to the matching HF model. The EOS suppression costs both sides the same trivial op.

Caveats of the comparison (architectural, not bugs): tpe_train is post-norm with biases and a
GNMT-style beam search written in Python; Marian and BART are post-norm too (BART adds an embedding
LayerNorm and a ``final_logits_bias``), T5 is pre-norm RMSNorm without biases, and its
``dropout_rate`` also drops attention probabilities (it has no separate attention dropout). The
activation is ReLU everywhere (Marian and BART configs are set to ``relu``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout without installing the package
    sys.path.insert(0, str(ROOT))

from tpe_train.model import kernels  # noqa: E402
from tpe_train.model.args import ModelArgs  # noqa: E402
from tpe_train.model.generate import beam_search  # noqa: E402
from tpe_train.model.loss import label_smoothed_loss  # noqa: E402
from tpe_train.model.transformer import Memory, Transformer  # noqa: E402
from tpe_train.positions import POSITIONS, PositionArgs  # noqa: E402
from tpe_train.train import throughput as perf  # noqa: E402

D_MODEL, N_HEADS, FFN_DIM, LAYERS, VOCAB = 256, 4, 1024, 3, 8000
PAD, BOS, EOS, FIRST_ID = 0, 1, 2, 3
BATCH, N_BATCHES = 128, 4
MIN_LEN, MAX_LEN = 24, 36  # content tokens per sentence (the target adds EOS)
DECODE_BATCH, DECODE_NEW = 64, 30  # decoding: sentences per batch; N (decoder steps = N + 1)
EPSILON, LR, SEED = 0.1, 1e-4, 1234
HF_MATCH = {"sinusoidal": "hf-marian", "learned": "hf-bart", "t5": "hf-t5"}
DEVICE = torch.device("cpu")  # --device; every model, batch and matmul operand lives there
CLOCK = time.perf_counter  # --cpu-time: time.thread_time, the CPU time of the (one) computing thread


def sync() -> None:
    """Wait for the device's queued work, so that a wall-clock interval covers it (GPU kernels are
    asynchronous; on the CPU this does nothing)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


# --------------------------------------------------------------------------------------- data


@dataclass
class Batch:
    src: Tensor  # (B, Ls) right-padded
    tgt_in: Tensor  # (B, Lt) BOS + target
    tgt_out: Tensor  # (B, Lt) target + EOS
    ntok: int  # non-pad target tokens


def _padded(rows: list[Tensor], length: int) -> Tensor:
    out = torch.full((len(rows), length), PAD, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


def _lengths(gen: torch.Generator, n: int) -> list[int]:
    """Uniform in [MIN_LEN, MAX_LEN], one sentence at MAX_LEN so every batch pads to the same shape."""
    lengths = torch.randint(MIN_LEN, MAX_LEN + 1, (n,), generator=gen)
    lengths[int(torch.randint(n, (1,), generator=gen))] = MAX_LEN
    return lengths.tolist()


def _sentences(gen: torch.Generator, n: int) -> list[Tensor]:
    return [torch.randint(FIRST_ID, VOCAB, (length,), generator=gen) for length in _lengths(gen, n)]


def make_batches(seed: int) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(N_BATCHES):
        src = _sentences(gen, BATCH)
        tgt = _sentences(gen, BATCH)
        bos, eos = torch.tensor([BOS]), torch.tensor([EOS])
        tgt_in = _padded([torch.cat((bos, t)) for t in tgt], MAX_LEN + 1)
        tgt_out = _padded([torch.cat((t, eos)) for t in tgt], MAX_LEN + 1)
        ntok = int((tgt_out != PAD).sum())
        batches.append(Batch(_padded(src, MAX_LEN).to(DEVICE), tgt_in.to(DEVICE), tgt_out.to(DEVICE), ntok))
    return batches


def make_decode_sources(seed: int) -> Tensor:
    return _padded(_sentences(torch.Generator().manual_seed(seed + 1), DECODE_BATCH), MAX_LEN).to(DEVICE)


# -------------------------------------------------------------------------------------- FLOPs


def forward_flops(ls: int, lt: int) -> dict[str, int]:
    """Matmul FLOPs of one forward pass of one sentence at padded lengths (ls, lt); see perf.py."""
    return perf.forward_flops(D_MODEL, FFN_DIM, LAYERS, LAYERS, VOCAB, ls, lt)


# --------------------------------------------------------------------------------------- peak


PEAK_SHAPES = [(4096, 256, 1024), (4096, 1024, 256), (4096, 256, 256), (4096, 256, 8000)]
PEAK_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class PeakRow:
    """The GEMM peaks (``perf.Peak``, every kernel on the model's shapes); a row of the interleaved
    rounds too, so that the peak behind MFU is measured under the same machine load as the steps."""

    name, dtype, warmup_steps = "gemm-peak", "", 0  # warmed up by its constructor

    def __init__(self, dtypes: list[str], reps: int, native_bf16: bool = True) -> None:
        self.reps = reps
        self.times: list[float] = []
        # a GPU comes near its peak only on large products: an 8,192-cube there
        shapes = PEAK_SHAPES if DEVICE.type == "cpu" else [*PEAK_SHAPES, (8192, 8192, 8192)]
        self.peaks = {
            dt: perf.Peak(
                PEAK_DTYPES[dt], DEVICE, perf.gemm_kernels(PEAK_DTYPES[dt], DEVICE, native_bf16), shapes
            )
            for dt in dtypes
        }

    def step(self) -> None:
        for peak in self.peaks.values():
            peak.sample(self.reps)

    def result(self) -> dict[str, Any]:
        """Per dtype: median GFLOP/s per shape and kernel, and the peak = the best of them."""
        out = {}
        for dt, peak in self.peaks.items():
            table = peak.table(statistics.median)
            best = max((g, f"{kernel} {shape}") for shape, row in table.items() for kernel, g in row.items())
            out[dt] = {"per_shape_gflops": table, "peak_gflops": best[0], "peak_at": best[1]}
        return out


def merge_peaks(during: dict[str, Any], start: dict[str, Any]) -> dict[str, Any]:
    """The peaks MFU is taken against: those measured during training, raised by any kernel that was
    measured only at the start (PyTorch's bf16 kernel where the CPU has no bf16 kernels)."""
    out = {}
    for dt, info in during.items():
        kernels_during = {k for row in info["per_shape_gflops"].values() for k in row}
        extra = [
            (g, f"{k} {shape} (at start)")
            for shape, row in start[dt]["per_shape_gflops"].items()
            for k, g in row.items()
            if k not in kernels_during
        ]
        best = max([(info["peak_gflops"], info["peak_at"]), *extra])
        out[dt] = {**info, "peak_gflops": best[0], "peak_at": best[1]}
    return out


def print_peak(label: str, peak: dict[str, Any]) -> None:
    for dt, info in peak.items():
        print(f"{dt} GEMM peak {label}: {info['peak_gflops']:6.1f} GFLOP/s ({info['peak_at']})")
        for shape, row in info["per_shape_gflops"].items():
            print(f"    {shape:<20}" + "  ".join(f"{k} {g:6.1f}" for k, g in row.items()))


def kernel_table(reps: int, rows: int = 1024) -> list[dict[str, Any]]:
    """Each training product of each model shape through PyTorch's kernel and the alternative
    (oneDNN for fp32, widened to fp32 for bf16): median GFLOP/s, and the one ``auto`` takes here."""
    onednn_faster, widens = kernels.cpu_rules()
    gen = torch.Generator().manual_seed(1)
    out = []
    for dt, dtype in PEAK_DTYPES.items():
        other = "onednn" if dt == "fp32" else "widened"
        auto = other if (onednn_faster if dt == "fp32" else widens) else "torch"
        for _, k, n in PEAK_SHAPES:
            x, w, g = (
                torch.randn(r, c, generator=gen).to(DEVICE, dtype) for r, c in ((rows, k), (n, k), (rows, n))
            )
            for product, (torch_fn, other_fn) in _products(x, w, g, dt == "fp32" or onednn_faster).items():
                fns = {"torch": torch_fn, other: other_fn}
                times = _time_each(fns, reps)
                rates = {name: 2 * rows * k * n / t / 1e9 for name, t in times.items()}
                out.append(
                    {
                        "dtype": dt,
                        "shape": f"{rows}x{k}->{n}",
                        "product": product,
                        "gflops": rates,
                        "auto": auto,
                    }
                )
    return out


def _products(x: Tensor, w: Tensor, g: Tensor, onednn: bool) -> dict[str, tuple[Any, Any]]:
    """The forward x W^T, input gradient g W and weight gradient g^T x: PyTorch's kernel, and the
    other as training computes it (``model/kernels.py``; bf16 widened to fp32 and rounded back)."""
    up = (lambda t: t.float()) if x.dtype == torch.bfloat16 else (lambda t: t)
    return {
        "forward": (lambda: torch.mm(x, w.t()), lambda: kernels._mm_t(up(x), up(w), onednn).to(x.dtype)),
        "input grad": (lambda: torch.mm(g, w), lambda: kernels._mm_t(up(g), up(w).t(), onednn).to(x.dtype)),
        "weight grad": (
            lambda: torch.mm(g.t(), x),
            lambda: kernels.weight_grad(up(g), up(x), onednn).to(x.dtype),
        ),
    }


def _time_each(fns: dict[str, Any], reps: int) -> dict[str, float]:
    """Median seconds of each function, the calls interleaved (after one untimed call each)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            sync()
            t0 = CLOCK()
            fn()
            sync()
            times[name].append(CLOCK() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def print_kernel_table(table: list[dict[str, Any]]) -> None:
    print(f"\n{'dtype':<6}{'product':<13}{'shape':<15}{'torch':>8}{'the other':>18}  auto takes")
    for r in table:
        rates = r["gflops"]
        other = next(k for k in rates if k != "torch")
        faster = max(rates, key=rates.get)
        slower_pick = faster != r["auto"] and abs(rates[other] / rates["torch"] - 1) >= 0.1
        print(
            f"{r['dtype']:<6}{r['product']:<13}{r['shape']:<15}{rates['torch']:>8.1f}{other:>10}"
            f"{rates[other]:>8.1f}  {r['auto']}{'  (the other was >10% faster)' if slower_pick else ''}"
        )


# ------------------------------------------------------------------------------------- models


def tpe_model(kind: str) -> Transformer:
    torch.manual_seed(SEED)
    args = ModelArgs(
        vocab_size=VOCAB,
        pad_id=PAD,
        bos_id=BOS,
        eos_id=EOS,
        d_model=D_MODEL,
        n_heads=N_HEADS,
        ffn_dim=FFN_DIM,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        dropout=0.1,
        encoder_position=kind,
        decoder_position=kind,
        position=PositionArgs(d_model=D_MODEL, n_heads=N_HEADS, causal=False, max_positions=1024),
    )
    return Transformer(args)


def hf_model(name: str) -> nn.Module:
    """A Hugging Face encoder-decoder of the benchmark's shape, random weights, no download."""
    import transformers as tf

    torch.manual_seed(SEED)
    ids = {"pad_token_id": PAD, "bos_token_id": BOS, "eos_token_id": EOS, "decoder_start_token_id": BOS}
    if name in ("hf-marian", "hf-bart"):
        common = dict(
            vocab_size=VOCAB,
            d_model=D_MODEL,
            encoder_layers=LAYERS,
            decoder_layers=LAYERS,
            encoder_attention_heads=N_HEADS,
            decoder_attention_heads=N_HEADS,
            encoder_ffn_dim=FFN_DIM,
            decoder_ffn_dim=FFN_DIM,
            activation_function="relu",
            dropout=0.1,
            attention_dropout=0.0,
            activation_dropout=0.0,
            encoder_layerdrop=0.0,
            decoder_layerdrop=0.0,
            max_position_embeddings=1024,
            scale_embedding=True,
            tie_word_embeddings=True,
            forced_eos_token_id=None,
            **ids,
        )
        if name == "hf-marian":
            config = tf.MarianConfig(
                decoder_vocab_size=VOCAB, share_encoder_decoder_embeddings=True, **common
            )
            return tf.MarianMTModel(config)
        return tf.BartForConditionalGeneration(tf.BartConfig(forced_bos_token_id=None, **common))
    if name == "hf-t5":
        config = tf.T5Config(
            vocab_size=VOCAB,
            d_model=D_MODEL,
            d_kv=D_MODEL // N_HEADS,
            d_ff=FFN_DIM,
            num_layers=LAYERS,
            num_decoder_layers=LAYERS,
            num_heads=N_HEADS,
            relative_attention_num_buckets=32,
            relative_attention_max_distance=128,
            dropout_rate=0.1,
            feed_forward_proj="relu",
            tie_word_embeddings=True,
            **ids,
        )
        return tf.T5ForConditionalGeneration(config)
    raise ValueError(name)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def attn_impl(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "_attn_implementation", "sdpa/explicit")) if config else "sdpa/explicit"


# ------------------------------------------------------------------------------------ training


@dataclass
class TrainRow:
    name: str  # "none" ... "rope", "hf-marian", ...
    dtype: str  # "fp32" | "bf16"
    model: nn.Module
    batches: list[Batch]
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    _step: int = 0

    def __post_init__(self) -> None:
        self.model.to(DEVICE).train()
        params = self.model.parameters()  # the trainer's optimizer: one fused kernel for all
        self.opt = torch.optim.Adam(params, lr=LR, betas=(0.9, 0.98), eps=1e-8, fused=True)
        self.hf = self.name.startswith("hf-")

    def logits(self, b: Batch) -> Tensor:
        if self.hf:
            return self.model(
                input_ids=b.src,
                attention_mask=(b.src != PAD).long(),
                decoder_input_ids=b.tgt_in,
                use_cache=False,
            ).logits
        return self.model(b.src, b.tgt_in)

    def step(self) -> None:
        b = self.batches[self._step % len(self.batches)]
        self._step += 1
        self.opt.zero_grad(set_to_none=True)
        ctx = (
            torch.autocast(DEVICE.type, dtype=torch.bfloat16)
            if self.dtype == "bf16"
            else contextlib.nullcontext()
        )
        with ctx:
            logits = self.logits(b)
            scale = 1.0 / b.ntok  # the gradient's factor, passed as the trainer passes it
            loss, _, ntok = label_smoothed_loss(logits, b.tgt_out, PAD, EPSILON, scale)
        (loss * scale).backward()
        self.opt.step()
        self.losses.append(float(loss.detach()) / int(ntok))


# ------------------------------------------------------------------------------------ decoding


def suppress_early_eos(model: Transformer, n: int) -> Transformer:
    """Per instance: EOS logit -inf while fewer than ``n`` target tokens were decoded."""
    inner = model.decode

    def decode(tgt_in: Tensor, memory: Memory, cache: Any = None) -> Tensor:
        offset = cache.offset if cache is not None else 0
        logits = inner(tgt_in, memory, cache)
        if cache is not None and offset < n:
            logits[..., EOS] = float("-inf")
        return logits

    model.decode = decode  # type: ignore[method-assign]
    return model


@dataclass
class DecodeRow:
    name: str
    model: nn.Module
    src: Tensor
    times: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.model.to(DEVICE).eval()
        self.hf = self.name.startswith("hf-")
        if self.hf:
            from transformers import GenerationConfig

            self.gen_config = GenerationConfig(
                num_beams=4,
                length_penalty=0.6,
                min_new_tokens=DECODE_NEW + 1,
                max_new_tokens=DECODE_NEW + 1,
                do_sample=False,
                early_stopping=False,
                suppress_tokens=[PAD],
                use_cache=True,
                pad_token_id=PAD,
                bos_token_id=BOS,
                eos_token_id=EOS,
                decoder_start_token_id=BOS,
            )
        else:
            assert isinstance(self.model, Transformer)
            suppress_early_eos(self.model, DECODE_NEW)

    def step(self) -> None:
        with torch.inference_mode():
            if self.hf:
                out = self.model.generate(  # type: ignore[operator]
                    input_ids=self.src,
                    attention_mask=(self.src != PAD).long(),
                    generation_config=self.gen_config,
                )
                # minus the decoder start token; EOS never appears (suppressed throughout)
                self.lengths = [out.shape[1] - 1] * out.shape[0]
            else:
                assert isinstance(self.model, Transformer)
                hyps = beam_search(
                    self.model, self.src, beam=4, alpha=0.6, max_len_a=0.0, max_len_b=DECODE_NEW + 1
                )
                self.lengths = [len(h) + 1 for h in hyps]  # + the EOS step


# -------------------------------------------------------------------------------------- runner


def run_interleaved(rows: list[Any], warmup: int, steps: int, label: str) -> None:
    """Warm every row up, then ``steps`` rounds of one timed step per row, order rotated per round."""
    for row in rows:
        t0 = time.perf_counter()
        for _ in range(getattr(row, "warmup_steps", warmup)):
            row.step()
        print(
            f"  [{label}] warmed up {row.name:<11} {getattr(row, 'dtype', '')}"
            f" in {time.perf_counter() - t0:6.1f} s",
            file=sys.stderr,
            flush=True,
        )
    gc.collect()
    for r in range(steps):
        t_round = time.perf_counter()
        shift = r % len(rows)
        for row in rows[shift:] + rows[:shift]:
            sync()
            t0 = CLOCK()
            row.step()
            sync()
            row.times.append(CLOCK() - t0)
        print(
            f"  [{label}] round {r + 1}/{steps} in {time.perf_counter() - t_round:6.1f} s",
            file=sys.stderr,
            flush=True,
        )


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def train_results(rows: list[TrainRow], batches: list[Batch], peak: dict[str, Any]) -> list[dict[str, Any]]:
    flops = forward_flops(MAX_LEN, MAX_LEN + 1)["total"] * BATCH * 3
    mean_tok = statistics.mean(b.ntok for b in batches)
    base = {r.dtype: statistics.median(r.times) for r in rows if r.name == "none"}
    hf = {(r.name, r.dtype): mean_tok / statistics.median(r.times) for r in rows if r.hf}
    results = []
    for r in rows:
        step = statistics.median(r.times)
        tps = mean_tok / step
        match = HF_MATCH.get(r.name)
        results.append(
            {
                "model": r.name,
                "dtype": r.dtype,
                "params": n_params(r.model),
                "attention": attn_impl(r.model),
                "tokens_per_s": tps,
                "step_ms": 1000 * step,
                "step_ms_min": 1000 * min(r.times),
                "step_ms_all": [1000 * t for t in r.times],
                "vs_hf": tps / hf[(match, r.dtype)] if (match, r.dtype) in hf else None,
                "vs_none": step / base[r.dtype] if r.dtype in base else None,
                "model_gflops": flops / step / 1e9,
                "mfu": flops / step / 1e9 / peak[r.dtype]["peak_gflops"],
                "last_loss": r.losses[-1],
            }
        )
    return results


def print_train(results: list[dict[str, Any]]) -> None:
    print(
        f"\n{'model':<12}{'dtype':<6}{'tok/s':>9}{'step ms':>10}{'min ms':>8}{'vs HF':>8}{'vs none':>9}"
        f"{'GFLOP/s':>9}{'MFU':>7}{'params':>10}  attention"
    )
    for r in results:
        print(
            f"{r['model']:<12}{r['dtype']:<6}{r['tokens_per_s']:>9.0f}{r['step_ms']:>10.0f}{r['step_ms_min']:>8.0f}"
            f"{_fmt(r['vs_hf'], '.2f'):>8}{_fmt(r['vs_none'], '.2f'):>9}{r['model_gflops']:>9.1f}"
            f"{100 * r['mfu']:>6.1f}%{r['params'] / 1e6:>9.2f}M  {r['attention']}"
        )
    over = [f"{r['model']} {r['dtype']}" for r in results if r["mfu"] > 1]
    if over:  # a model cannot outrun the best GEMM: the peak was measured under a heavier load
        print(f"WARNING: MFU above 100% for {', '.join(over)}: the peak measurement was disturbed")


def decode_results(rows: list[DecodeRow]) -> list[dict[str, Any]]:
    res = {}
    for r in rows:
        t = statistics.median(r.times)
        res[r.name] = {
            "model": r.name,
            "seconds": t,
            "sentences_per_s": DECODE_BATCH / t,
            "tokens_per_s": sum(r.lengths) / t,
            "decoded_steps_per_sentence": statistics.mean(r.lengths),
            "seconds_min": min(r.times),
            "seconds_all": r.times,
        }
    for out in res.values():
        match = HF_MATCH.get(out["model"])
        out["vs_hf"] = out["sentences_per_s"] / res[match]["sentences_per_s"] if match in res else None
    return list(res.values())


def print_decode(results: list[dict[str, Any]]) -> None:
    print(f"\n{'model':<12}{'sent/s':>9}{'tok/s':>9}{'steps':>7}{'batch s':>9}{'vs HF':>8}")
    for r in results:
        print(
            f"{r['model']:<12}{r['sentences_per_s']:>9.1f}{r['tokens_per_s']:>9.0f}"
            f"{r['decoded_steps_per_sentence']:>7.1f}{r['seconds']:>9.2f}{_fmt(r['vs_hf'], '.2f'):>8}"
        )


# ---------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    kinds = POSITIONS.names()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10, help="timed training steps per row (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed training steps per row (default 3)")
    p.add_argument(
        "--only",
        type=lambda s: [k.strip() for k in s.split(",") if k.strip()],
        default=kinds,
        help=f"comma-separated tpe encodings ({','.join(kinds)}); HF rows follow their match",
    )
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face models")
    p.add_argument("--no-decode", action="store_true", help="skip the beam-search benchmark")
    p.add_argument("--no-train", action="store_true", help="skip the training benchmark (decoding only)")
    p.add_argument("--decode-rounds", type=int, default=3, help="timed beam-search batches a row (default 3)")
    p.add_argument("--no-bf16", action="store_true", help="training in fp32 only")
    p.add_argument(
        "--no-hf-bf16",
        action="store_true",
        help="no bf16 rows for the HF models (on a CPU without bf16 kernels each step takes minutes)",
    )
    p.add_argument(
        "--cpu-gemm",
        default="auto",
        choices=kernels.CPU_GEMM_MODES,
        help="train.cpu_gemm of the tpe rows (default auto)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument(
        "--cpu-time",
        action="store_true",
        help="time steps and GEMMs by the CPU time of the computing thread (needs --threads 1): what a "
        "shared machine's other processes take is then not counted",
    )
    p.add_argument(
        "--device", default="cpu", help="cpu (default) or cuda[:N]: where every model, batch and matmul runs"
    )
    p.add_argument("--json", type=Path, help="write every number to this file")
    args = p.parse_args(argv)
    if args.cpu_time and args.threads != 1:
        p.error("--cpu-time measures one thread: add --threads 1")
    unknown = [k for k in args.only if k not in kinds]
    if unknown:
        p.error(f"unknown encoding(s) {unknown}; choose from {kinds}")
    return args


def run_training(
    args: argparse.Namespace,
    kinds: list[str],
    hf_names: list[str],
    dtypes: list[str],
    batches: list[Batch],
    peak_start: dict[str, Any],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The training rows, interleaved with the GEMM peak; printed, and returned (with that peak)."""
    train_rows = [
        TrainRow(name, dtype, tpe_model(name) if not name.startswith("hf-") else hf_model(name), batches)
        for dtype in dtypes
        for name in [*kinds, *hf_names]
        if not (args.no_hf_bf16 and dtype == "bf16" and name.startswith("hf-"))
    ]
    during = PeakRow(dtypes, reps=3, native_bf16=False)
    run_interleaved([*train_rows, during], args.warmup, args.steps, "train")
    peak = merge_peaks(during.result(), peak_start)
    train = train_results(train_rows, batches, peak)
    print()
    print_peak("during training (interleaved with the steps; used for MFU)", peak)
    print(
        f"\ntraining step (fwd + label-smoothed loss + bwd + fused Adam), median of {args.steps}"
        f" interleaved steps after {args.warmup} warm-up;\nvs HF = tok/s / tok/s of matching HF model"
        " (>1: tpe faster);"
        " vs none = step time / tpe none's (same dtype);\nMFU = model FLOP/s / the GEMM peak of the row's"
        " dtype (best kernel and shape, measured during training)"
    )
    print_train(train)
    del train_rows
    gc.collect()
    return train, peak


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    global DEVICE, CLOCK
    DEVICE = torch.device(args.device)
    CLOCK = time.thread_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    perf.configure_cpu(args.cpu_gemm, DEVICE)  # as the trainer: GEMM kernels, allocator
    started = time.perf_counter()
    kinds = [k for k in POSITIONS.names() if k in args.only]
    hf_names = [] if args.no_hf else [HF_MATCH[k] for k in kinds if k in HF_MATCH]
    dtypes = ["fp32"] if args.no_bf16 else ["fp32", "bf16"]
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    env = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "loadavg_at_start": load,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "cpu",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_gemm": args.cpu_gemm,
        "clock": "thread CPU time" if args.cpu_time else "wall",
        "rules (onednn faster, bf16 widened)": kernels.cpu_rules(),
    }
    if hf_names:
        import transformers

        env["transformers"] = transformers.__version__
    print(f"env: {env}")

    fl = forward_flops(MAX_LEN, MAX_LEN + 1)
    batches = make_batches(SEED)
    mean_tok = statistics.mean(b.ntok for b in batches)
    print(
        f"\nshape: d_model {D_MODEL}, {N_HEADS} heads, FFN {FFN_DIM}, {LAYERS}+{LAYERS} layers,"
        f" vocab {VOCAB}; batch {BATCH}, padded Ls {MAX_LEN} / Lt {MAX_LEN + 1},"
        f" {mean_tok:.0f} target tokens/batch (mean)"
    )
    print("model FLOPs (matmul, 2/MAC, padded lengths; training = 3 x forward):")
    for part, value in fl.items():
        print(
            f"  {part:<14} {value / 1e6:9.2f} MFLOP/sentence fwd  {value * BATCH / 1e9:8.2f} GFLOP/batch fwd"
            f"  {3 * value * BATCH / 1e9:8.2f} GFLOP/batch train"
        )

    print("\nGEMM GFLOP/s per shape and kernel (median; peak = best shape and kernel):")
    sampler = PeakRow(dtypes, reps=3)
    sampler.step()
    peak_start = sampler.result()
    print_peak("at start", peak_start)
    table = kernel_table(reps=5) if DEVICE.type == "cpu" else []
    if table:
        print("\nthe training products at 1024 rows, GFLOP/s (median of 5): PyTorch's kernel and the other")
        print_kernel_table(table)

    train: list[dict[str, Any]] = []
    peak: dict[str, Any] = {}
    if not args.no_train:
        train, peak = run_training(args, kinds, hf_names, dtypes, batches, peak_start)

    decode: list[dict[str, Any]] = []
    if not args.no_decode:
        src = make_decode_sources(SEED)
        rows = [DecodeRow(k, tpe_model(k), src) for k in kinds] + [
            DecodeRow(n, hf_model(n), src) for n in hf_names
        ]
        run_interleaved(rows, min(args.warmup, 1), max(1, args.decode_rounds), "decode")
        decode = decode_results(rows)
        print(
            f"\nbeam search: beam 4, alpha 0.6, KV cache, fp32, {DECODE_BATCH} sentences"
            f" (src {MIN_LEN}-{MAX_LEN}),"
            f" exactly {DECODE_NEW + 1} decoder steps per sentence (EOS suppressed before), median batch time"
        )
        print_decode(decode)

    elapsed = time.perf_counter() - started
    if hasattr(os, "getloadavg"):
        env["loadavg_at_end"] = os.getloadavg()
        print(f"load average at start {env['loadavg_at_start']}, at end {env['loadavg_at_end']}")
    print(f"\ntotal {elapsed:.0f} s")
    if args.json:
        payload = {
            "env": env,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "shape": {
                "d_model": D_MODEL,
                "heads": N_HEADS,
                "ffn": FFN_DIM,
                "layers": LAYERS,
                "vocab": VOCAB,
                "batch": BATCH,
                "src_padded": MAX_LEN,
                "tgt_padded": MAX_LEN + 1,
                "target_tokens_per_batch": mean_tok,
            },
            "forward_flops_per_sentence": fl,
            "train_flops_per_step": fl["total"] * BATCH * 3,
            "peak_at_start": peak_start,
            "kernel_table": table,
            "peak_during_training": peak,
            "train": train,
            "decode": decode,
            "seconds": elapsed,
        }
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
