"""Run under ``accelerate launch`` by tests/test_distributed.py: real engines, real process groups.

    accelerate launch --config_file X.yaml tests/support/dist_harness.py tp OUT.json [kinds...]
    accelerate launch --config_file X.yaml tests/support/dist_harness.py tp-flex OUT.json [kinds...]
    accelerate launch --config_file X.yaml tests/support/dist_harness.py \
        zero OUT.json STEPS [CPU_GEMM] [compile]
    accelerate launch --config_file X.yaml tests/support/dist_harness.py ac OUT.json [STAGES...]

``tp``: for each encoding, one training step of the tensor-parallel engine the launch file describes,
and the same step of one plain process on the same batch; records both losses and gradient norms
and the largest difference of the consolidated parameters after the step ("sinusoidal+onednn": with
``train.cpu_gemm=onednn`` on both sides; ``onednn_nodes`` counts the products that took oneDNN).
``tp-flex``: for each encoding, the validation loss (forward only: FlexAttention has no CPU backward)
of the tensor-parallel engine with ``model.attention=flex``, and of one plain process with
``explicit`` attention on the same batch.
``zero``: STEPS steps where each of the data-parallel ranks takes its half of a fixed global batch;
the reference is one plain process taking the whole global batch (as two accumulated halves);
records losses, gradient norms and the largest parameter difference after every step; CPU_GEMM:
``train.cpu_gemm`` of both (default auto). With ``compile``, the ranks' layers are compiled
(``train.compile``); the reference stays eager.
``ac``: as ``zero`` (2 steps), with every encoder and decoder layer checkpointed
(``train.activation_checkpointing=layers``) and the output layer and loss taken in chunks of 16 target
tokens (``train.loss_chunk_tokens``) on the ranks, neither in the reference; for each ZeRO
stage in STAGES (the launch's DeepSpeed engine rebuilt with that stage), else the launch's own layout.
Rank 0 writes the figures to OUT.json; the test asserts on them.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from tpe_train.config import Config, load_config
from tpe_train.data.batching import BOS_ID, EOS_ID, Batch, model_args, pad
from tpe_train.model.build import build_model
from tpe_train.model.kernels import set_cpu_gemm
from tpe_train.parallel import vocab
from tpe_train.parallel.context import ParallelContext
from tpe_train.parallel.deepspeed import ProcessLayout, deepspeed_config, resolve_layout
from tpe_train.parallel.engine import Engine, torch_optimizer
from tpe_train.parallel.memory import memory_report
from tpe_train.parallel.plan import split_dim
from tpe_train.run.exits import end_process
from tpe_train.train.build import build_engine, build_optimizer, build_train_model
from tpe_train.train.precision import autocast_dtype
from tpe_train.train.step import batch_loss, train_step

VOCAB = 64


def config(
    kind: str, accumulate: int = 1, dropout: float = 0.0, cpu_gemm: str = "auto", extra: tuple[str, ...] = ()
) -> Config:
    set_cpu_gemm(cpu_gemm)  # as the trainer does at start-up (process-wide)
    return load_config(
        "demo",
        [
            f"model.position.kind={kind}",
            "model.d_model=32",
            "model.n_heads=4",
            "model.ffn_dim=64",
            "model.encoder_layers=2",
            "model.decoder_layers=2",
            f"model.dropout={dropout}",
            "model.position.max_positions=64",
            "model.position.shaw_clip=3",
            "model.position.shaw_values=true",
            "model.position.t5_buckets=8",
            "model.position.t5_max_distance=16",
            "data.max_len=60",
            f"train.accumulate={accumulate}",
            "train.clip_norm=1000",  # clipping on, never binding: the norm is computed and reported
            "train.label_smoothing=0.1",
            "train.lr=1e-4",  # Adam moves every parameter by about lr per step: 5e-4 in 5 steps
            # eps 1e-6, not the paper's 1e-9: some gradients are zero in exact arithmetic (key biases:
            # softmax ignores a constant added to every logit) and are rounding noise of ~1e-10 whose
            # sign depends on the summation order; Adam with eps 1e-9 turns that noise into full +-lr steps.
            "train.adam_eps=1e-6",
            f"train.cpu_gemm={cpu_gemm}",
            *extra,
        ],
    )


def model_for(cfg: Config) -> torch.nn.Module:
    return build_model(model_args(cfg.model, VOCAB), seed=0)


def batch(seed: int, rows: int = 4) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (rows,), generator=g).tolist()
    src = [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in lengths]
    tgt = [[*r[::-1], EOS_ID] for r in src]
    return Batch(
        ids=torch.arange(rows),
        src=pad([[*r, EOS_ID] for r in src]),
        tgt_in=pad([t[:-1] for t in tgt], prefix=BOS_ID),
        tgt_out=pad(tgt),
    )


def engine_for(cfg: Config, ctx: ParallelContext, ds: dict[str, Any] | None) -> Engine:
    from accelerate.state import AcceleratorState, GradientState

    if ds is not None:  # one Accelerator per DeepSpeed engine built in this process
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    torch.manual_seed(0)  # the weights of ``model_for``
    model = build_train_model(cfg, VOCAB, ctx)
    # The trainer's optimizer (train.adam_eps 1e-6 in ``config``) at a constant lr: each step moves the
    # parameters by about lr, which the tests' thresholds count on.
    opt = build_optimizer(model, cfg.train)
    return build_engine(model, cfg, ctx, ds, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[Any]:
    diffs = sorted(((float((a[k] - b[k]).abs().max()), k) for k in a), reverse=True)
    return diffs[:4]


def tp_check(kinds: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    widths: list[int] = []  # the width of every block of logits the vocabulary-parallel loss scores
    real = vocab._VocabParallelCE.apply

    def recorded(logits: torch.Tensor, *rest: Any) -> Any:
        widths.append(logits.shape[-1])
        return real(logits, *rest)

    vocab._VocabParallelCE.apply = recorded  # type: ignore[method-assign]
    ctx = None
    # "+dropout": residual dropout 0.1, applied to activations every TP rank holds whole. The ranks
    # share one RNG stream, so they draw the same masks, which are also the single process's masks.
    for name in [*kinds, "sinusoidal+dropout", "sinusoidal+onednn"]:
        kind = name.split("+")[0]
        gemm = "onednn" if name.endswith("+onednn") else "auto"
        cfg = config(kind, dropout=0.1 if name.endswith("+dropout") else 0.0, cpu_gemm=gemm)
        layout = resolve_layout(cfg)
        ctx = ctx or ParallelContext.from_env(layout.tp_size, deepspeed=True)
        b = batch(1)
        sharded = engine_for(cfg, ctx, deepspeed_config(cfg, layout))
        torch.manual_seed(1)
        widths.clear()
        stats = train_step(sharded, [b], cfg, ctx, amp_dtype=None).read(ctx)
        after = full_weights(sharded)
        plain = engine_for(cfg, ParallelContext.fake(), None)
        torch.manual_seed(1)
        ref = train_step(plain, [b], cfg, ParallelContext.fake(), amp_dtype=None).read(ParallelContext.fake())
        out[name] = {
            "onednn_nodes": onednn_nodes(sharded, b),
            "ref_onednn_nodes": onednn_nodes(plain, b),
            "memory": memory(sharded, ctx, layout),
            "ref_memory": memory(plain, ParallelContext.fake(), None),
            "tp_size": ctx.tp_size,
            "logit_widths": sorted(set(widths)),  # the vocabulary-parallel loss's logits per rank
            "loss": stats["loss"],
            "ref_loss": ref["loss"],
            "grad_norm": stats["grad_norm"],
            "ref_grad_norm": ref["grad_norm"],
            "param_diff": max_diff(after, full_weights(plain)),
            "worst": worst(after, full_weights(plain)),
            "position_params": {
                n: list(p.shape) for n, p in sharded.module.named_parameters() if "positions" in n
            },
        }
    return out


def onednn_nodes(engine: Engine, b: Batch) -> int:
    """How many products of a forward pass ran through oneDNN's training linear (autograd nodes
    ``_CpuLinearBackward`` in the graph of the logits): which kernels the engine's layers take, on
    the parameters DeepSpeed gathered."""
    logits = engine.forward(b.src.to(engine.ctx.device), b.tgt_in.to(engine.ctx.device))
    return graph_nodes(logits, "_CpuLinearBackward")


def graph_nodes(out: torch.Tensor, name: str) -> int:
    """How many nodes of type ``name`` the autograd graph of ``out`` holds."""
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(n for n, _ in node.next_functions)
    return sum(type(n).__name__ == name for n in seen)


def tp_flex_check(kinds: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ctx = None
    for kind in kinds:
        # Shaw's keys through flex (its relative values would take the explicit path)
        cfg = config(kind, extra=("model.position.shaw_values=false", "model.attention=flex"))
        # the layout of the same run without flex (resolve_layout refuses flex for CPU *training*)
        layout = resolve_layout(config(kind, extra=("model.position.shaw_values=false",)))
        ctx = ctx or ParallelContext.from_env(layout.tp_size, deepspeed=True)
        b = batch(3)
        sharded = engine_for(cfg, ctx, deepspeed_config(cfg, layout))
        ref_cfg = config(kind, extra=("model.position.shaw_values=false", "model.attention=explicit"))
        plain = engine_for(ref_cfg, ParallelContext.fake(), None)
        with torch.no_grad():
            _, nll, ntok = batch_loss(sharded.forward, b, cfg, amp_dtype=None)
            _, ref_nll, _ = batch_loss(plain.forward, b, ref_cfg, amp_dtype=None)
        out[kind] = {"tp_size": ctx.tp_size, "nll": float(nll) / ntok, "ref_nll": float(ref_nll) / ntok}
    return out


def lockstep(
    sharded: Engine, plain: Engine, cfg: Config, cfg2: Config, ctx: ParallelContext, steps: int
) -> Iterator[tuple[dict[str, float], dict[str, float], float]]:
    """Each step: this rank's share of the global batch through the sharded engine, the whole batch
    through one plain process; yields both steps' figures and the largest parameter difference."""
    cast, ref_cast = autocast_dtype(cfg, sharded.uses_deepspeed), autocast_dtype(cfg2, False)
    for step in range(steps):
        halves = [batch(100 * step + r, rows=3 + r) for r in range(ctx.dp_size)]
        stats = train_step(sharded, [halves[ctx.dp_rank]], cfg, ctx, cast).read(ctx)
        ref = train_step(plain, halves, cfg2, ParallelContext.fake(), ref_cast).read(ParallelContext.fake())
        if sharded.ddp:  # which backward searched for unused parameters; then settled as the loop does
            stats["find_unused"] = float(sharded.model.find_unused_parameters)
        if step == 0:
            sharded.settle([])  # every parameter of these models gets a gradient
        yield stats, ref, max_diff(full_weights(sharded), full_weights(plain))


#: fp16 with a first loss scale that overflows: the first updates are skipped on every rank alike
FP16 = ("train.fp16=true", "train.loss_scale_power=18", "train.loss_scale_window=2")


def zero_check(
    steps: int, cpu_gemm: str = "auto", compiled: bool = False, fp16: bool = False
) -> dict[str, Any]:
    extra = (("train.compile=true",) if compiled else ()) + (FP16 if fp16 else ())
    cfg = config("t5", cpu_gemm=cpu_gemm, extra=extra)
    layout = resolve_layout(cfg)
    ctx = ParallelContext.from_env(layout.tp_size, deepspeed=layout.deepspeed is not None)
    ds = deepspeed_config(cfg, layout) if layout.deepspeed is not None else None
    sharded = engine_for(cfg, ctx, ds)
    cfg2 = config("t5", accumulate=ctx.dp_size, cpu_gemm=cpu_gemm, extra=FP16 if fp16 else ())
    plain = engine_for(cfg2, ParallelContext.fake(), None)
    rows = []
    for stats, ref, diff in lockstep(sharded, plain, cfg, cfg2, ctx, steps):
        rows.append(
            {
                "loss": stats["loss"],
                "ref_loss": ref["loss"],
                "grad_norm": stats["grad_norm"],
                "ref_grad_norm": ref["grad_norm"],
                "param_diff": diff,
                "moved": max_diff(full_weights(plain), model_state(cfg)),
                "find_unused": stats.get("find_unused"),
            }
        )
    return {
        "onednn_nodes": onednn_nodes(sharded, batch(100 * (steps - 1) + ctx.dp_rank, rows=3 + ctx.dp_rank)),
        "dp_size": ctx.dp_size,
        "compiled": compiled,
        "loss_scale": sharded.loss_scale_state(),
        "ref_loss_scale": plain.loss_scale_state(),
        "zero_stage": layout.zero_stage,
        "steps": rows,
        "memory": memory(sharded, ctx, layout),
        "ref_memory": memory(plain, ParallelContext.fake(), None),
    }


def ac_check(stages: list[int], steps: int = 2) -> dict[str, Any]:
    cfg = config("t5", extra=("train.activation_checkpointing=layers", "train.loss_chunk_tokens=16"))
    layout = resolve_layout(cfg)
    ctx = ParallelContext.from_env(layout.tp_size, deepspeed=layout.deepspeed is not None)
    cfg2 = config("t5", accumulate=ctx.dp_size)
    out: dict[str, Any] = {"dp_size": ctx.dp_size, "tp_size": ctx.tp_size}
    for stage in stages or [layout.zero_stage]:
        lay = layout
        if stages:
            zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
            lay = replace(layout, deepspeed={**(layout.deepspeed or {}), "zero_optimization": zero})
        sharded = engine_for(cfg, ctx, deepspeed_config(cfg, lay) if lay.deepspeed is not None else None)
        plain = engine_for(cfg2, ParallelContext.fake(), None)
        rows = [
            {"loss": stats["loss"], "ref_loss": ref["loss"], "param_diff": diff}
            for stats, ref, diff in lockstep(sharded, plain, cfg, cfg2, ctx, steps)
        ]
        out[str(stage)] = rows
    return out


def memory(engine: Engine, ctx: ParallelContext, layout: ProcessLayout | None) -> dict[str, Any]:
    """The start-up report and, after the steps, the optimizer state bytes really held."""
    report = memory_report(engine.module, engine.optimizer, ctx.rank, layout).as_dict()
    report["optimizer_state_held"] = optimizer_state_bytes(engine.optimizer)
    return report


def model_state(cfg: Config) -> dict[str, torch.Tensor]:
    return {n: p.detach().float() for n, p in model_for(cfg).named_parameters()}


def full_weights(engine: Engine) -> dict[str, Tensor]:
    """The single-device model's fp32 weights, whole, on every rank (a collective over all ranks).
    Tests compare layouts with it; checkpoints never gather."""
    ctx, weights = engine.ctx, {}
    for name, p in engine.module.named_parameters():
        if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):
            from deepspeed.utils import safe_get_full_fp32_param

            value = safe_get_full_fp32_param(p).float()
        else:
            value = p.detach().float()
        dim = split_dim(name, p) if ctx.tp_size > 1 else None
        if dim is not None:
            parts = [torch.empty_like(value) for _ in range(ctx.tp_size)]
            dist.all_gather(parts, value.contiguous(), group=ctx.tp_group)
            value = torch.cat(parts, dim=dim)
        weights[name] = value.cpu().clone()
    return weights


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the state tensors the torch optimizer actually holds (after a step)."""
    basic = torch_optimizer(optimizer)
    return sum(
        t.numel() * t.element_size()
        for state in basic.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )


def main() -> None:
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "tp":
        result = tp_check(sys.argv[3:])
    elif mode == "tp-flex":
        result = tp_flex_check(sys.argv[3:])
    elif mode == "ac":
        result = ac_check([int(a) for a in sys.argv[3:]])
    else:
        rest = sys.argv[4:]
        gemm = next((a for a in rest if a not in ("compile", "fp16")), "auto")
        result = zero_check(int(sys.argv[3]), gemm, compiled="compile" in rest, fp16="fp16" in rest)
    if torch.distributed.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
    end_process(0)  # as tpe-train's ranks leave: no interpreter finalization with gloo groups alive
