"""Training-step and beam-search throughput of tpe_train's encodings against Hugging Face models.

Run from the repository root (CPU; the numbers are only comparable *within one run*)::

    python benchmarks/bench_train.py                     # everything: ~10 min on 2 idle cores
    python benchmarks/bench_train.py --steps 2 --warmup 1 --only none,rope --no-decode
    python benchmarks/bench_train.py --json bench.json   # also write every number
    python benchmarks/bench_train.py --device cuda       # on a GPU (timings synchronise the device)
    python benchmarks/bench_train.py --threads 1 --cpu-time   # one thread, timed by its CPU time: a
                                                         # busy machine's other processes not counted
    python benchmarks/bench_train.py --smoke --json x.json    # small mode: a tiny shape, one step a
                                                         # row, a few seconds (the CI smoke test)

Shape (one issue's: ``harness.BENCH_SHAPE``, the model built by ``cfg.model.args``): d_model 256, 4
heads, FFN 1024, 3 + 3 layers, one shared vocabulary of 8,000 with tied embeddings, dropout 0.1
(attention and activation dropout 0), batches of 128 sentences
whose source and target lengths are uniform in [24, 36] (target + EOS: ~31 tokens, ~4,000 target
tokens per batch), right-padded to 36 source / 37 target positions. Token ids are random (3..7999,
fixed seed) and every model sees the same batches in the same order.

What is measured
----------------
1. **Peak** (``tpe_train/train/throughput.py``, the trainer's MFU uses the same code; ``harness.PeakRow``):
   GFLOP/s of every way the machine multiplies the model's own GEMM shapes ((4096x256)@(256x1024),
   (4096x1024)@(1024x256), (4096x256)@(256x256), (4096x256)@(256x8000)): PyTorch's kernel (MKL for
   fp32 on x86), oneDNN's, and for bf16 on a CPU the operands widened to fp32 (with either library).
   Per dtype, the peak is the best (shape, kernel) median. It is measured once at the start and
   again as one more row of the interleaved training rounds (3 timed repetitions per kernel and shape
   per round, each group after 2 untimed calls: AMX runs its first calls after other work at half its
   rate); MFU uses the latter, taken under the same machine load as the steps (where the CPU has no
   bf16 kernels, PyTorch's bf16 kernel is too slow to repeat there: its at-start rate enters the peak
   instead).
   A kernel table also prints each training product -- forward x W^T, input gradient g W, weight
   gradient g^T x -- through PyTorch's kernel and through oneDNN (fp32) or widened (bf16), and
   which one ``train.cpu_gemm=auto`` takes on this processor.
2. **Training step**: forward + label-smoothed loss (eps 0.1, ``label_smoothed_loss`` on the logits
   for *every* model, HF ones included, never HF's ``labels=``) + backward + the trainer's
   optimizer step (fused AdamW with the config's settings and lr schedule), dropout on,
   in fp32 and under ``torch.autocast("cpu", dtype=torch.bfloat16)`` around forward + loss (fp32
   master weights). Rows: every tpe_train encoding, plus Hugging Face models of the same shape built
   from a config with random weights (``peers.py``): MarianMT (sinusoidal) <-> ``sinusoidal``, BART (learned
   absolute) <-> ``learned``, T5 (relative bucket bias) <-> ``t5``. All timed steps are interleaved
   round-robin over the rows (one step of each row per round, order rotated every round), so a
   load change on a shared machine hits all rows alike; the reported step time is the median.
   Columns: target tokens/s (mean non-pad target tokens per batch / median step time), step ms,
   ``vs HF`` = tokens/s of the row / tokens/s of its matching HF model (> 1: tpe_train faster),
   ``vs none`` = step time / step time of tpe ``none`` in the same dtype, MFU = model FLOP/s /
   the measured peak of the row's dtype. The process runs as the trainer does
   (``tpe_train.train.cpu_setup.configure_cpu``: ``train.cpu_gemm``, allocator), HF rows included.
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
import gc
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from harness import (
    DTYPES,
    SEED,
    SMOKE_BATCHES,
    FnRow,
    PeakRow,
    TrainRow,
    Uniform,
    bench_config,
    build,
    environment,
    gemm_shapes,
    interleave,
    model_args,
    n_params,
    parse_with_smoke,
    summary,
    write_json,
)
from peers import HF_MATCH, DecodeRow, attn_impl, hf_model
from torch import Tensor

from tpe_train.config import Config
from tpe_train.model import kernels
from tpe_train.model.args import ModelArgs
from tpe_train.positions import POSITIONS
from tpe_train.train import cpu_setup, throughput

EPSILON = 0.1
BATCHES = Uniform()  # 4 batches of 128 sentences of 24..36 content tokens (the target adds EOS)
DECODE_BATCH, DECODE_NEW = 64, 30  # decoding: sentences per batch; N (decoder steps = N + 1)
SMOKE_DECODE = 4, 3


# --------------------------------------------------------------------------------------- peak


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


def kernel_table(
    shapes: list[tuple[int, int, int]], device: torch.device, clock: Any, reps: int, rows: int = 1024
) -> list[dict[str, Any]]:
    """Each training product of each model shape through PyTorch's kernel and the alternative
    (oneDNN for fp32, widened to fp32 for bf16): median GFLOP/s, and the one ``auto`` takes here.
    The calls of one product are interleaved (after one untimed call each)."""
    onednn_faster, widens = kernels.cpu_rules()
    gen = torch.Generator().manual_seed(1)
    out = []
    for dt, dtype in DTYPES.items():
        other = "onednn" if dt == "fp32" else "widened"
        auto = other if (onednn_faster if dt == "fp32" else widens) else "torch"
        for _, k, n in shapes:
            x, w, g = (
                torch.randn(r, c, generator=gen).to(device, dtype) for r, c in ((rows, k), (n, k), (rows, n))
            )
            for product, (torch_fn, other_fn) in _products(x, w, g, dt == "fp32" or onednn_faster).items():
                fns = [FnRow("torch", torch_fn, warmup_steps=1), FnRow(other, other_fn, warmup_steps=1)]
                interleave(
                    fns, 1, reps, device, "kernels", clock=clock, collect="never", rotate=False, quiet=True
                )
                rates = {f.name: 2 * rows * k * n / statistics.median(f.times) / 1e9 for f in fns}
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


def make_model(cfg: Config, name: str) -> torch.nn.Module:
    """tpe_train's model with encoding ``name`` as the config describes it, or its HF peer."""
    if name.startswith("hf-"):
        return hf_model(name, model_args(cfg), seed=SEED)
    return build(cfg, name, seed=SEED)


def forward_flops(args: ModelArgs, ls: int, lt: int) -> dict[str, int]:
    """Matmul FLOPs of one forward pass of one sentence at padded lengths (ls, lt), by part."""
    return throughput.forward_flops(
        args.d_model, args.ffn_dim, args.encoder_layers, args.decoder_layers, args.vocab_size, ls, lt
    )


# -------------------------------------------------------------------------------------- results


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def train_results(
    rows: list[TrainRow], batches: list[Any], peak: dict[str, Any], flops: int
) -> list[dict[str, Any]]:
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
                "step_ms_p90": summary(r.times, 1000)["p90"],
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


def decode_results(rows: list[DecodeRow], sentences: int) -> list[dict[str, Any]]:
    res = {}
    for r in rows:
        t = statistics.median(r.times)
        res[r.name] = {
            "model": r.name,
            "seconds": t,
            "sentences_per_s": sentences / t,
            "tokens_per_s": sum(r.lengths) / t,
            "decoded_steps_per_sentence": statistics.mean(r.lengths),
            "seconds_min": min(r.times),
            "seconds_p90": summary(r.times)["p90"],
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
    # small mode: besides these, the shape harness.SMOKE_SHAPE and small batches
    args = parse_with_smoke(p, argv, {"steps": 1, "warmup": 1, "decode_rounds": 1})
    if args.cpu_time and args.threads != 1:
        p.error("--cpu-time measures one thread: add --threads 1")
    unknown = [k for k in args.only if k not in kinds]
    if unknown:
        p.error(f"unknown encoding(s) {unknown}; choose from {kinds}")
    return args


def run_training(
    args: argparse.Namespace,
    cfg: Config,
    names: list[str],
    dtypes: list[str],
    batches: list[Any],
    peak_start: dict[str, Any],
    flops: int,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The training rows, interleaved with the GEMM peak; printed, and returned (with that peak)."""
    device = torch.device(args.device)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    train_rows = [
        TrainRow(name, make_model(cfg, name), batches, device, cfg.train, dtype, EPSILON)
        for dtype in dtypes
        for name in names
        if not (args.no_hf_bf16 and dtype == "bf16" and name.startswith("hf-"))
    ]
    during = PeakRow(dtypes, device, gemm_shapes(model_args(cfg), device), reps=3, native_bf16=False)
    interleave([*train_rows, during], args.warmup, args.steps, device, "train", clock=clock)
    peak = merge_peaks(during.result(), peak_start)
    train = train_results(train_rows, batches, peak, flops)
    print()
    print_peak("during training (interleaved with the steps; used for MFU)", peak)
    print(
        f"\ntraining step (fwd + label-smoothed loss + bwd + fused AdamW), median of {args.steps}"
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
    device = torch.device(args.device)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    cpu_setup.configure_cpu(args.cpu_gemm, device)  # as the trainer: GEMM kernels, allocator
    started = time.perf_counter()
    cfg = bench_config(args.smoke)
    shape = model_args(cfg)
    uniform = SMOKE_BATCHES if args.smoke else BATCHES
    decode_batch, decode_new = SMOKE_DECODE if args.smoke else (DECODE_BATCH, DECODE_NEW)
    kinds = [k for k in POSITIONS.names() if k in args.only]
    hf_names = [] if args.no_hf else [HF_MATCH[k] for k in kinds if k in HF_MATCH]
    dtypes = ["fp32"] if args.no_bf16 else ["fp32", "bf16"]
    env = environment(
        device,
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        cpu_gemm=args.cpu_gemm,
        clock="thread CPU time" if args.cpu_time else "wall",
        **{"rules (onednn faster, bf16 widened)": kernels.cpu_rules()},
    )
    if hf_names:
        import transformers

        env["transformers"] = transformers.__version__
    print(f"env: {env}")

    ls, lt = uniform.hi, uniform.hi + 1
    fl = forward_flops(shape, ls, lt)
    flops = throughput.train_flops(shape, [(uniform.size, ls, lt)])
    batches = uniform.batches(shape.vocab_size, SEED, device)
    mean_tok = statistics.mean(b.ntok for b in batches)
    print(
        f"\nshape: d_model {shape.d_model}, {shape.n_heads} heads, FFN {shape.ffn_dim},"
        f" {shape.encoder_layers}+{shape.decoder_layers} layers, vocab {shape.vocab_size};"
        f" batch {uniform.size}, padded Ls {ls} / Lt {lt}, {mean_tok:.0f} target tokens/batch (mean)"
    )
    print("model FLOPs (matmul, 2/MAC, padded lengths; training = 3 x forward):")
    for part, value in fl.items():
        print(
            f"  {part:<14} {value / 1e6:9.2f} MFLOP/sentence fwd  {value * uniform.size / 1e9:8.2f}"
            f" GFLOP/batch fwd  {3 * value * uniform.size / 1e9:8.2f} GFLOP/batch train"
        )

    print("\nGEMM GFLOP/s per shape and kernel (median; peak = best shape and kernel):")
    shapes = gemm_shapes(shape, device)
    sampler = PeakRow(dtypes, device, shapes, reps=3)
    sampler.step()
    peak_start = sampler.result()
    print_peak("at start", peak_start)
    table = kernel_table(gemm_shapes(shape), device, clock, reps=5) if device.type == "cpu" else []
    if table:
        print("\nthe training products at 1024 rows, GFLOP/s (median of 5): PyTorch's kernel and the other")
        print_kernel_table(table)

    train: list[dict[str, Any]] = []
    peak: dict[str, Any] = {}
    if not args.no_train:
        train, peak = run_training(args, cfg, [*kinds, *hf_names], dtypes, batches, peak_start, flops)

    decode: list[dict[str, Any]] = []
    if not args.no_decode:
        src = uniform.sources(shape.vocab_size, decode_batch, SEED + 1, device)
        rows = [DecodeRow(n, make_model(cfg, n), src, decode_new + 1) for n in [*kinds, *hf_names]]
        interleave(rows, min(args.warmup, 1), max(1, args.decode_rounds), device, "decode", clock=clock)
        decode = decode_results(rows, decode_batch)
        print(
            f"\nbeam search: beam 4, alpha 0.6, KV cache, fp32, {decode_batch} sentences"
            f" (src {uniform.lo}-{uniform.hi}),"
            f" exactly {decode_new + 1} decoder steps per sentence (EOS suppressed before), median batch time"
        )
        print_decode(decode)

    elapsed = time.perf_counter() - started
    if hasattr(os, "getloadavg"):
        env["loadavg_at_end"] = os.getloadavg()
        print(f"load average at start {env['loadavg_at_start']}, at end {env['loadavg_at_end']}")
    print(f"\ntotal {elapsed:.0f} s")
    write_json(
        args.json,
        {
            "env": env,
            "args": vars(args),
            "shape": {
                "d_model": shape.d_model,
                "heads": shape.n_heads,
                "ffn": shape.ffn_dim,
                "layers": shape.encoder_layers,
                "vocab": shape.vocab_size,
                "batch": uniform.size,
                "src_padded": ls,
                "tgt_padded": lt,
                "target_tokens_per_batch": mean_tok,
            },
            "forward_flops_per_sentence": fl,
            "train_flops_per_step": flops,
            "peak_at_start": peak_start,
            "kernel_table": table,
            "peak_during_training": peak,
            "train": train,
            "decode": decode,
            "seconds": elapsed,
        },
    )


if __name__ == "__main__":
    main()
