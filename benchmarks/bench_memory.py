"""Peak memory and time of one training step (forward + backward) under the trainer's memory settings,
side by side in one run: activation checkpointing (``train.activation_checkpointing``: none, layers,
every_n) with and without the output layer and loss in chunks (``train.loss_chunk_tokens``).

Run from the repository root::

    python benchmarks/bench_memory.py --steps 0               # memory only: base model, 64 x 64 tokens
    python benchmarks/bench_memory.py --device cuda --bf16    # a GPU: peak allocated, CUDA-event time
    python benchmarks/bench_memory.py --smoke --json out.json # small mode: a tiny model, seconds

The step is the trainer's (``tpe_train.train.step.batch_terms``, then the backward of the loss over
its tokens) on a model of ``--preset`` (default the base WMT model: d 512, 6 + 6 layers, 37,000 words,
dropout 0.1) and a batch of ``--batch`` x ``--length`` random source and target tokens. Each row's
model is built once with the same seed; gradients are set to None before every step.

Memory, above the weights: on a GPU, ``torch.cuda.max_memory_allocated`` over the step less what was
allocated before it; on a CPU, the peak of torch's ``MemTracker`` (``torch.distributed._tools``: the
bytes of live tensors as a dispatch mode sees them made and freed) less the parameters' bytes, one
extra step per row under the tracker. Both count what the step's tensors hold, not an allocator's
cache; the gradients are part of it.

Time: ``--warmup`` untimed steps, then ``--steps`` rounds of one timed step per row, the row order
rotated each round (``harness.interleave``); the median per row and its ratio to the plain row's
(none, whole). GPU: CUDA events; CPU: wall clock, outside the tracker. ``--steps 0``: memory only.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch
from harness import SMOKE_MODEL, Batch, build, interleave, parse_with_smoke, write_json

from tpe_train.config import Config, load_config
from tpe_train.parallel.checkpointing import apply_activation_checkpointing
from tpe_train.train.step import batch_terms


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="wmt14_en_de_base", help="the model's preset")
    parser.add_argument("--batch", type=int, default=64, help="sentences per batch")
    parser.add_argument("--length", type=int, default=64, help="source and target tokens per sentence")
    parser.add_argument("--chunk", type=int, default=1024, help="train.loss_chunk_tokens of the chunked rows")
    parser.add_argument(
        "--modes", default="none,layers,every_n", help="train.activation_checkpointing values"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast, as train.bf16")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per row")
    parser.add_argument("--steps", type=int, default=3, help="timed rounds (0: memory only)")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    small = {"batch": 4, "length": 12, "chunk": 16, "warmup": 1, "steps": 2}
    return parse_with_smoke(parser, argv, small)


def row_config(args: argparse.Namespace, mode: str, chunk: int) -> Config:
    overrides = [f"train.activation_checkpointing={mode}", f"train.loss_chunk_tokens={chunk}"]
    smoke = [*SMOKE_MODEL, "data.vocab_size=500"] if args.smoke else []
    return load_config(args.preset, [*overrides, *smoke])


def random_batch(cfg: Config, args: argparse.Namespace, device: torch.device) -> Batch:
    gen = torch.Generator().manual_seed(1)
    vocab = cfg.data.vocab_size
    src = torch.randint(4, vocab, (args.batch, args.length), generator=gen)
    tgt = torch.randint(4, vocab, (args.batch, args.length + 1), generator=gen)
    return Batch(src.to(device), tgt[:, :-1].to(device), tgt[:, 1:].to(device), tgt[:, 1:].numel())


class Row:
    def __init__(self, args: argparse.Namespace, mode: str, chunk: int, device: torch.device) -> None:
        self.name = f"{mode}/{'chunks of ' + str(chunk) if chunk else 'whole'}"
        self.cfg = row_config(args, mode, chunk)
        self.model = build(self.cfg, device=device).train()
        if mode != "none":
            apply_activation_checkpointing(self.model, mode, self.cfg.train.checkpoint_every)
        self.batch = random_batch(self.cfg, args, device)
        self.cast, self.device = torch.bfloat16 if args.bf16 else None, device
        self.times: list[float] = []

    def step(self) -> None:
        self.model.zero_grad(set_to_none=True)
        scale = 1.0 / self.batch.ntok
        loss, _, _ = batch_terms(self.model, self.batch, self.cfg, self.cast, scale)  # type: ignore[arg-type]
        (loss * scale).backward()

    def peak_mib(self) -> float:
        self.model.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            self.step()
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - before) / 2**20
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(self.model)
        with tracker:
            self.step()
        peak = tracker.get_tracker_snapshot("peak")[self.device]["Total"]
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return (peak - weights) / 2**20


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = [Row(args, mode, chunk, device) for mode in args.modes.split(",") for chunk in (0, args.chunk)]
    cfg = rows[0].cfg
    print(
        f"{args.preset}: d {cfg.model.d_model}, {cfg.model.encoder_layers} + {cfg.model.decoder_layers} "
        f"layers, {cfg.data.vocab_size} words; batch {args.batch} x {args.length} tokens; {device}"
        f"{' bf16' if args.bf16 else ' fp32'}; torch {torch.__version__}"
    )
    peaks = {row.name: row.peak_mib() for row in rows}
    if args.steps:
        interleave(rows, args.warmup, args.steps, device, "step")
    plain = rows[0]
    figures = []
    print(
        f"{'row':24s} {'peak above weights':>19s} {'vs none/whole':>14s} {'step':>10s} {'vs none/whole':>14s}"
    )
    for row in rows:
        ms = statistics.median(row.times) * 1e3 if row.times else None
        ratio = ms / (statistics.median(plain.times) * 1e3) if ms is not None else None
        figures.append(
            {"row": row.name, "peak_mib": peaks[row.name], "peak_ratio": peaks[plain.name] / peaks[row.name],
             "step_ms": ms, "time_ratio": ratio}
        )  # fmt: skip
        time_text = f"{ms:8.1f} ms {ratio:13.2f}x" if ms is not None else f"{'-':>10s} {'-':>14s}"
        print(f"{row.name:24s} {peaks[row.name]:15.1f} MiB {figures[-1]['peak_ratio']:13.2f}x {time_text}")
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": figures}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
