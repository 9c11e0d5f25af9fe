"""Sharded checkpoints against the gathering save they replaced: memory, time and bytes, in one run.

    DS_ACCELERATOR=cpu python benchmarks/bench_checkpoint.py [--layouts zero3x2,zero3x4,zero2x2] [--json F]
    DS_ACCELERATOR=cpu python benchmarks/bench_checkpoint.py --smoke --json F   # small mode: a tiny
                                                                                # model, ZeRO-3 x 2 only

Each layout is a real ``accelerate launch`` of this script on CPU processes over gloo (DeepSpeed
ZeRO-3 with 2 and 4 processes, ZeRO-2 with 2), holding the ``wmt14_en_de_big`` model (d 1024, 16
heads, FFN 4096, 6 + 6 layers, shared vocabulary 37,000: 213M parameters) after one real optimizer step
on a small batch, so that Adam's moments exist. In that one process group, in this order:

- ``sharded``: ``ckpt.state.Checkpointer.save`` (each rank writes its own pieces), then ``restore``;
- ``sharded async``: the same with ``train.async_save``: the blocking part (staging the rank's pieces in
  host memory) and the total until the checkpoint is published;
- ``gathering``: the save this replaced, kept below as the peer: every rank gathers the whole model
  and both moments in fp32 (``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``, one
  collective per parameter and tensor), rank 0 writes them, and every rank writes DeepSpeed's own
  shards (``accelerator.save_state``); its load reads the whole files on every rank and scatters them.

Memory is each rank's peak resident set during the call over its resident set when the call starts
(``harness.added_peak_rss``: ``VmHWM`` after resetting it through ``/proc/self/clear_refs``, free heap
returned to the system with ``malloc_trim`` first), so it counts what the call adds. Time is the
slowest rank's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from harness import (
    ROOT,
    SMOKE_SHAPE,
    accelerate_cmd,
    added_peak_rss,
    build,
    dir_bytes,
    parse_with_smoke,
    run_checked,
    write_json,
)

from tpe_train.ckpt.store import sha256

LAYOUTS = {"zero3x2": ("zero3.json", 2), "zero3x4": ("zero3.json", 4), "zero2x2": ("zero2.json", 2)}


# --- the gathering save and load that sharded checkpoints replaced (the former parallel/portable.py) ----


def gather_state(engine: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    weights, moments = {}, {}
    for name, p in engine.module.named_parameters():  # no tensor parallelism in these layouts
        weights[name] = safe_get_full_fp32_param(p).float().cpu()
        for m in ("exp_avg", "exp_avg_sq"):
            moments[f"{m}/{name}"] = safe_get_full_optimizer_state(p, m).float().cpu()
    return weights, moments


def gathering_save(engine: Any, out: Path) -> None:
    from safetensors.torch import save_file

    engine.accelerator.save_state(str(out / "deepspeed"))
    weights, moments = gather_state(engine)
    if engine.ctx.is_main:
        save_file(weights, str(out / "model.safetensors"))
        save_file(moments, str(out / "optimizer.safetensors"))
    engine.ctx.barrier()
    if engine.ctx.is_main:  # the manifest: rank 0 hashed every file
        [sha256(p) for p in sorted(out.rglob("*")) if p.is_file()]
    engine.ctx.barrier()


def gathering_load(engine: Any, out: Path) -> None:
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    from safetensors.torch import load_file

    for name in ("model.safetensors", "optimizer.safetensors"):  # every rank checked the files' hashes
        sha256(out / name)
    weights, moments = (
        load_file(str(out / "model.safetensors")),
        load_file(str(out / "optimizer.safetensors")),
    )
    with engine.gathered(modify=True) as full:
        for name, p in full.named_parameters():
            p.data.copy_(weights[name].to(p.dtype))
    for name, p in engine.module.named_parameters():
        safe_set_full_fp32_param(p, weights[name])
        for m in ("exp_avg", "exp_avg_sq"):
            safe_set_full_optimizer_state(p, moments[f"{m}/{name}"], m)


# --- one launched process ------------------------------------------------------------------------------


class Position:
    """Stands in for the data position a run saves (``TrainBatches``): nothing to read here."""

    per_rank = False

    def state_dict(self) -> dict[str, int]:
        return {"epoch": 0, "taken": 0}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


def engine_of(cfg: Any, ctx: Any, deepspeed: dict[str, Any] | None) -> tuple[Any, int]:
    """The trainer's engine (``tpe_train.train.build``) over the preset's model (seed 0), and the
    model's parameter count (before ZeRO partitions it)."""
    from tpe_train.train.build import build_engine

    model = build(cfg, seed=0).train()
    params = sum(p.numel() for p in model.parameters())
    return build_engine(model, cfg, ctx, deepspeed), params


def worker(out_json: Path, work: Path, preset: str, smoke: bool) -> None:
    from tokenizers import Tokenizer, models

    from tpe_train.ckpt.state import Checkpointer, Progress
    from tpe_train.config import load_config
    from tpe_train.data.batching import BOS_ID, EOS_ID, Batch, pad
    from tpe_train.parallel.context import ParallelContext
    from tpe_train.parallel.deepspeed import deepspeed_config, resolve_layout
    from tpe_train.train.step import train_step

    # one checkpoint kept, none averaged (the WMT presets average the last 5 or 20)
    overrides = ["train.threads=1", "eval.select=last", "eval.average_last=1", "train.keep_last=1",
                 "train.clip_norm=0", "train.accumulate=1", "train.batch_tokens=0"]  # fmt: skip
    cfg = load_config(preset, [*overrides, *(SMOKE_SHAPE if smoke else [])])
    layout = resolve_layout(cfg)
    ctx = ParallelContext.from_env(layout.tp_size, deepspeed=True)
    torch.set_num_threads(1)
    vocab = cfg.data.vocab_size
    engine, params = engine_of(cfg, ctx, deepspeed_config(cfg, layout))
    g = torch.Generator().manual_seed(ctx.rank)
    rows = [torch.randint(4, vocab, (12,), generator=g).tolist() for _ in range(4)]
    src, tgt = pad([[*r, EOS_ID] for r in rows]), pad([[*r, EOS_ID] for r in rows])
    batch = Batch(ids=torch.arange(4), src=src, tgt_in=pad(rows, prefix=BOS_ID), tgt_out=tgt)
    train_step(engine, [batch], cfg, ctx, amp_dtype=None)  # Adam's moments exist from here on
    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1}, unk_token="<unk>"))
    progress = Progress(step=1, tokens=0.0)
    result: dict[str, Any] = {
        "parameters": params,
        "world_size": ctx.world_size,
        "zero_stage": layout.zero_stage,
    }

    def checkpointer(root: Path, background: bool) -> Checkpointer:
        cfg.train.async_save = background
        return Checkpointer(root, cfg, engine, tok, Position(), layout.zero_stage)  # type: ignore[arg-type]

    sharded = checkpointer(work / "sharded", background=False)
    result["sharded save"] = added_peak_rss(lambda: sharded.save(progress))
    result["sharded load"] = added_peak_rss(lambda: sharded.restore(work / "sharded" / "step-00000001"))
    background = checkpointer(work / "async", background=True)
    blocking: dict[str, float] = {}

    def async_save() -> None:
        blocking.update(added_peak_rss(lambda: background.save(progress)))
        background.wait()

    result["async save"] = added_peak_rss(async_save)
    result["async save"]["blocking_s"] = blocking["wall_s"]
    gathered = work / "gathering"
    if ctx.is_main:
        gathered.mkdir(parents=True, exist_ok=True)
    ctx.barrier()
    result["gathering save"] = added_peak_rss(lambda: gathering_save(engine, gathered))
    result["gathering load"] = added_peak_rss(lambda: gathering_load(engine, gathered))
    everyone = ctx.gather(result)
    if ctx.is_main:
        summary = {key: everyone[0][key] for key in ("parameters", "world_size", "zero_stage")}
        summary["ranks"] = everyone
        step = "step-00000001"
        summary["bytes"] = {
            "sharded": dir_bytes(work / "sharded" / step),
            "async": dir_bytes(work / "async" / step),
            "gathering": dir_bytes(gathered),
        }
        write_json(out_json, summary)


# --- the driver ----------------------------------------------------------------------------------------


def launch(name: str, work: Path, preset: str, smoke: bool) -> dict[str, Any]:
    ds_file, procs = LAYOUTS[name]
    launch_file = work / f"{name}.yaml"
    text = (ROOT / "configs" / "accelerate" / "cpu_zero3.yaml").read_text()
    text = text.replace("num_processes: 2", f"num_processes: {procs}")
    text = text.replace("configs/deepspeed/zero3.json", f"configs/deepspeed/{ds_file}")
    launch_file.write_text(text)
    out, place = work / f"{name}.json", work / name
    cmd = [*accelerate_cmd(launch_file), str(Path(__file__).resolve()), "--worker", str(out),
           "--dir", str(place), "--preset", preset, *(["--smoke"] if smoke else [])]  # fmt: skip
    run_checked(cmd, env={**os.environ, "DS_ACCELERATOR": "cpu"}, tail=6000)
    shutil.rmtree(place, ignore_errors=True)
    return dict(json.loads(out.read_text()))


def report(name: str, r: dict[str, Any]) -> list[str]:
    """One table per layout: the worst rank of each figure, and the ratios to the gathering save."""
    ranks, gib = r["ranks"], 2**30
    state = r["parameters"] * 4 * 3  # fp32 weights + two moments

    def mem(key: str) -> float:
        return max(x[key]["peak_extra_b"] for x in ranks) / gib

    def wall(key: str, field: str = "wall_s") -> float:
        return max(x[key][field] for x in ranks)

    size = {k: v / gib for k, v in r["bytes"].items()}
    rows = [
        ("peak extra RSS, save (GiB)", mem("sharded save"), mem("async save"), mem("gathering save")),
        ("peak extra RSS, load (GiB)", mem("sharded load"), None, mem("gathering load")),
        (
            "save, blocking (s)",
            wall("sharded save"),
            wall("async save", "blocking_s"),
            wall("gathering save"),
        ),
        ("save, until published (s)", wall("sharded save"), wall("async save"), wall("gathering save")),
        ("load (s)", wall("sharded load"), None, wall("gathering load")),
        ("bytes written (GiB)", size["sharded"], size["async"], size["gathering"]),
    ]
    lines = [
        f"{name}: {r['world_size']} processes, ZeRO-{r['zero_stage']}, {r['parameters'] / 1e6:.1f}M "
        f"parameters (fp32 weights + moments {state / gib:.2f} GiB); the worst rank of each figure",
        f"  {'':28s}{'sharded':>9s}{'async':>9s}{'gathering':>11s}{'sharded/g.':>12s}{'async/g.':>10s}",
    ]
    for label, sharded, background, gathering in rows:
        cells = [f"{x:9.2f}" if x is not None else " " * 9 for x in (sharded, background)]
        ratios = [f"{x / gathering:10.3f}" if x is not None else " " * 10 for x in (sharded, background)]
        lines.append(f"  {label:28s}{cells[0]}{cells[1]}{gathering:11.2f}  {ratios[0]}{ratios[1]}")
    lines.append(f"  bytes written / (weights + moments): sharded {r['bytes']['sharded'] / state:.3f}, "
                 f"gathering {r['bytes']['gathering'] / state:.3f}")  # fmt: skip
    for key in ("sharded save", "async save", "gathering save", "sharded load", "gathering load"):
        per_rank = " ".join(f"{x[key]['peak_extra_b'] / gib:.2f}" for x in ranks)
        lines.append(f"  peak extra RSS per rank, {key} (GiB): {per_rank}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="zero3x2,zero3x4,zero2x2", help=f"some of {', '.join(LAYOUTS)}")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--dir", type=Path, help="where checkpoints go (default: a temporary directory)")
    parser.add_argument(
        "--preset", default="wmt14_en_de_big", help="the model (a smaller preset for a dry run)"
    )
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    # small mode: the preset with a tiny model (harness.SMOKE_SHAPE), one layout
    args = parse_with_smoke(parser, None, {"layouts": "zero3x2"})
    if args.worker is not None:
        worker(args.worker, args.dir, args.preset, args.smoke)
        from tpe_train.run.exits import end_process

        end_process(0)  # a launched rank: no interpreter finalization with DeepSpeed's groups alive
    work = Path(tempfile.mkdtemp(prefix="tpe-bench-ckpt-", dir=args.dir))
    figures = {}
    try:
        for name in args.layouts.split(","):
            figures[name] = launch(name, work, args.preset, args.smoke)
            print("\n".join(report(name, figures[name])), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
