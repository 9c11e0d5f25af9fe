"""Attention backends at the WMT presets' shapes: every encoding, each backend, eager and compiled.

Run from the repository root; the numbers are only comparable *within one run*::

    python benchmarks/bench_attention.py --preset wmt14_en_de_base                   # CPU, fp32
    python benchmarks/bench_attention.py --preset wmt14_en_de_big --max-tokens 1000 --backends sdpa \\
        --compile-backends none --steps 2                                            # CPU, sized down
    python benchmarks/bench_attention.py --preset wmt14_en_de_big --device cuda --bf16   # one GPU
    python benchmarks/bench_attention.py --preset wmt14_en_de_base --no-train          # beam search
    python benchmarks/bench_attention.py --smoke --json x.json   # small mode: a tiny model, generated
                                                                 # text, no compilation; seconds

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
untimed steps pay the compilation). Steps are forward + label-smoothed loss + backward + the trainer's
AdamW and schedule (``harness.trainer_optimizer``, every row, Hugging Face rows too), fp32
(or bf16 autocast with ``--bf16``), dropout as in the preset. Printed per row: target tokens/s, the
median step, the step against ``none``'s row with the same backend and compilation in the same
group, the step's memory (GPU: peak allocated; CPU: bytes of the tensors autograd saves for the
backward pass, where the backends differ, as the CPU allocator keeps no peak), model FLOP/s and MFU
against the matmul peak measured in the same rounds on the model's own GEMM shapes (FLOP formula and
peak: ``tpe_train/train/throughput.py``, the best of PyTorch's and oneDNN's kernels). ``flex`` cannot train on
the CPU (no backward there in torch 2.13):
its rows are left out there and beam search compares it instead.

Beam search (``--decode``): beam 4, alpha 0.6, KV cache, eval mode, a batch of ``--decode-batch``
sentences from the middle of the length distribution, exactly ``--decode-steps`` decoder steps per
sentence (EOS suppressed before: ``peers.DecodeRow``, as in ``bench_train.py``), each backend of
``--decode-backends``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from harness import (
    EOS,
    PAD,
    SMOKE_SHAPE,
    Batch,
    Optimization,
    PeakRow,
    TrainRow,
    build,
    environment,
    gemm_shapes,
    interleave,
    length_batches,
    loadavg,
    model_args,
    p90,
    padded,
    parse_with_smoke,
    shared_data_stub,
    trainer_optimizer,
    write_json,
)
from peers import HF_MATCH, DecodeRow, attn_impl, hf_model
from torch import nn

from tpe_train.config import Config, load_config
from tpe_train.data.tokenizer import train_tokenizer
from tpe_train.model.attention import Attention
from tpe_train.model.transformer import Transformer
from tpe_train.positions import POSITIONS
from tpe_train.train import throughput

FIRST_ID = 4
DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

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


# --------------------------------------------------------------------------------------- model


def set_backend(model: nn.Module, backend: str) -> None:
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend = backend


def set_compiled(model: Transformer, compiled: dict[str, Any] | None) -> None:
    """Switch the model's stacks between their compiled layers and the eager ones."""
    for name in ("encoder", "decoder"):
        getattr(model, name).__dict__["_compiled"] = compiled[name] if compiled else None


def eager(model: Transformer, backend: str) -> Callable[[], None]:
    """What a beam-search row sets before it runs: its backend, the eager layers, eval mode."""

    def before() -> None:
        set_backend(model, backend)
        set_compiled(model, None)
        model.eval()

    return before


@dataclass
class Shared:
    """One model of a group and its optimizer, shared by its rows (they only differ in how they run)."""

    model: Transformer
    optimization: Optimization
    compiled: dict[str, Any] | None = None

    def compile(self) -> dict[str, Any]:
        if self.compiled is None:
            set_compiled(self.model, None)
            self.model.compile_layers()
            self.compiled = {n: getattr(self.model, n).__dict__["_compiled"] for n in ("encoder", "decoder")}
        return self.compiled


class BackendRow(TrainRow):
    """A training row of a shared model with one attention backend, eager or compiled."""

    def __init__(self, kind: str, backend: str, compiled: bool, shared: Shared, **kw: Any) -> None:
        self.kind, self.backend, self.compiled, self.shared = kind, backend, compiled, shared
        name = f"{kind}/{backend}{'+compile' if compiled else ''}"
        super().__init__(name, shared.model, optimization=shared.optimization, memory=True, **kw)

    def before_step(self) -> None:
        model = self.shared.model
        set_backend(model, self.backend)
        set_compiled(model, self.shared.compile() if self.compiled else None)
        model.train()


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
    # small mode: the preset with a tiny model (harness.SMOKE_SHAPE) on a generated stand-in of the shared
    # data (harness.shared_data_stub) unless --data; no compiled rows and no flex (on the CPU both
    # compile, for tens of seconds)
    smoke = {
        "data": None,
        "max_tokens": 300,
        "batches": 1,
        "kinds": ["rope"],
        "compile_backends": [],
        "hf": True,
        "steps": 1,
        "decode": ["t5"],
        "decode_backends": ["sdpa", "explicit"],
        "decode_batch": 2,
        "decode_steps": 3,
        "decode_rounds": 1,
    }
    args = parse_with_smoke(p, argv, smoke)
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


def hf_group(
    args: argparse.Namespace, preset: Config, batches: list[Batch], vocab: int, device: torch.device
) -> tuple[list[TrainRow], dict[str, Any]]:
    """tpe's sinusoidal, learned and t5 (eager, auto backend) against MarianMT, BART and T5."""
    eps, dtype = preset.train.label_smoothing, "bf16" if args.bf16 else "fp32"
    rows: list[TrainRow] = []
    for kind, hf in HF_MATCH.items():
        model = build(preset, kind, vocab, device)
        common = {"batches": batches, "device": device, "train": preset.train, "dtype": dtype, "epsilon": eps}
        shared = Shared(model, trainer_optimizer(model, preset.train))
        rows.append(BackendRow(kind, "auto", False, shared, **common))
        peer = hf_model(hf, model_args(preset, kind, vocab))
        rows.append(TrainRow(f"{hf}/{attn_impl(peer)}", peer, memory=True, **common))
    sampler = peak_row(args, preset, vocab, device)
    interleave([*rows, sampler], args.warmup, args.steps, device, "hf", collect="every step")
    return rows, sampler.result()


def train_group(
    args: argparse.Namespace,
    preset: Config,
    kind: str,
    batches: list[Batch],
    vocab: int,
    device: torch.device,
) -> tuple[list[BackendRow], dict[str, Any]]:
    torch._dynamo.reset()
    rows: list[BackendRow] = []
    common = {
        "batches": batches,
        "device": device,
        "train": preset.train,
        "dtype": "bf16" if args.bf16 else "fp32",
        "epsilon": preset.train.label_smoothing,
    }
    for k in ("none", kind):
        model = build(preset, k, vocab, device)
        shared = Shared(model, trainer_optimizer(model, preset.train))
        for backend in args.backends:
            rows.append(BackendRow(k, backend, False, shared, **common))
        if args.compile_kinds is None or kind in args.compile_kinds:
            for backend in args.compile_backends:
                rows.append(BackendRow(k, backend, True, shared, **common))
    sampler = peak_row(args, preset, vocab, device)
    interleave([*rows, sampler], args.warmup, args.steps, device, kind, collect="every step")
    return rows, sampler.result()


def peak_row(args: argparse.Namespace, preset: Config, vocab: int, device: torch.device) -> PeakRow:
    """The matmul peak (the best of PyTorch's and oneDNN's kernels) on the model's GEMM shapes at 4,096
    tokens, 2 samples a step; its warm-up steps are sampled too."""
    shapes = gemm_shapes(model_args(preset, vocab=vocab))
    dtype = "bf16" if args.bf16 else "fp32"
    return PeakRow([dtype], device, shapes, reps=2, native_bf16=False, name="matmul-peak", warmup_steps=None)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-attention-") as tmp:
        if args.data is None:  # --smoke without --data
            args.data = shared_data_stub(Path(tmp))
        run(args)


def run(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64  # several models, backends and compiled rows in one process
    torch._dynamo.config.accumulated_recompile_limit = 4096
    preset = load_config(args.preset, SMOKE_SHAPE if args.smoke else [])
    m, vocab = preset.model, preset.data.vocab_size
    max_tokens = args.max_tokens or preset.data.max_tokens
    started = time.perf_counter()
    env = environment(device)
    print(f"env: {env}")
    src_len, tgt_len = real_lengths(args.data, vocab)
    batches = length_batches(preset, src_len, tgt_len, args.batches, device, max_tokens, FIRST_ID)
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
        padded_size = b.src.numel() + b.tgt_out.numel()
        print(
            f"  batch {tuple(b.src.shape)} src, {tuple(b.tgt_in.shape)} tgt: {b.ntok} target tokens, "
            f"{100 * (1 - real / padded_size):.0f}% padding"
        )
    dtype = "bf16" if args.bf16 else "fp32"
    shape = model_args(preset, vocab=vocab)
    flops = [
        throughput.train_flops(shape, [(b.src.shape[0], b.src.shape[1], b.tgt_in.shape[1])]) for b in batches
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
                    "step_ms_p90": 1000 * p90(r.times),
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
        sentences = []
        for i in middle:
            words = torch.randint(FIRST_ID, vocab, (int(src_len[i]) - 1,), generator=gen)
            sentences.append(torch.cat((words, torch.tensor([EOS]))))
        src = padded(sentences, ls).to(device)
        groups = {
            kind: [
                DecodeRow(f"{kind}/{b}", model, src, args.decode_steps, before=eager(model, b))
                for b in args.decode_backends
            ]
            for kind in args.decode
            for model in [build(preset, kind, vocab, device)]
        }
        interleave(
            [r for group in groups.values() for r in group],
            1,
            args.decode_rounds,
            device,
            "beam",
            collect="every step",
        )
        print(
            f"\nbeam search: beam 4, {len(middle)} sentences (source {ls} tokens padded), exactly "
            f"{args.decode_steps} decoder steps each, fp32, median batch time; vs first = time / "
            f"{args.decode_backends[0]}'s"
        )
        print(f"{'row':<28}{'sent/s':>9}{'batch s':>9}{'vs first':>10}  same hypotheses")
        for mine in groups.values():
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

    env["loadavg_at_end"] = loadavg()
    elapsed = time.perf_counter() - started
    print(
        f"\nload average at start {env['loadavg_at_start']}, at end {env['loadavg_at_end']}; "
        f"total {elapsed:.0f} s"
    )
    write_json(
        args.json,
        {
            "env": env,
            "args": vars(args),
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
        },
    )


if __name__ == "__main__":
    main()
