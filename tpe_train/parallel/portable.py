"""The training state in a layout-free form: full fp32 weights and Adam moments of the single-device
model, keyed by parameter name, gathered from (and scattered back to) any layout.

This is what a checkpoint stores for resuming, so that a run can come back on a different number of
data-parallel ranks, another tensor-parallel size or another ZeRO stage with nothing to convert:
ZeRO partitions are read and written through DeepSpeed's public fragment API
(``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` and their ``safe_set_`` twins),
tensor-parallel shards are gathered along their split dimension (``plan.split_dim``) and sliced
again for the new layout. The tensors are plain fp32, written as safetensors: resuming never
unpickles anything.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from tpe_train.parallel.context import ParallelContext
from tpe_train.parallel.engine import Engine, torch_optimizer
from tpe_train.parallel.plan import split_dim

MOMENTS = ("exp_avg", "exp_avg_sq")


def _gather_tp(name: str, param: Tensor, local: Tensor, ctx: ParallelContext) -> Tensor:
    dim = split_dim(name, param) if ctx.tp_size > 1 else None
    if dim is None:
        return local
    parts = [torch.empty_like(local) for _ in range(ctx.tp_size)]
    dist.all_gather(parts, local.contiguous(), group=ctx.tp_group)
    return torch.cat(parts, dim=dim)


def _slice_tp(name: str, param: Tensor, full: Tensor, ctx: ParallelContext) -> Tensor:
    dim = split_dim(name, param) if ctx.tp_size > 1 else None
    if dim is None:
        return full
    return full.chunk(ctx.tp_size, dim=dim)[ctx.tp_rank].contiguous()


def adam_steps(engine: Engine) -> int:
    """Optimizer steps Adam has taken (its bias correction depends on it)."""
    for state in torch_optimizer(engine.optimizer).state.values():
        step = state.get("step")
        if step is not None:
            return int(step)
    return 0


def gather_state(engine: Engine, with_moments: bool = True) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(weights, moments) of the whole model, fp32, on every rank (a collective over all ranks).

    ``moments`` maps ``"<moment>/<parameter>"`` to Adam's ``exp_avg`` / ``exp_avg_sq``; empty before the
    first optimizer step or without ``with_moments``."""
    ctx, weights, moments = engine.ctx, {}, {}
    module = engine.module
    if engine.uses_deepspeed:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        started = with_moments and adam_steps(engine) > 0
        state = torch_optimizer(engine.optimizer).state
        for name, p in module.named_parameters():
            master = safe_get_full_fp32_param(p) if _fragments(p) else p.detach()
            weights[name] = _gather_tp(name, p, master.float(), ctx).cpu()
            for m in MOMENTS if started else ():
                local = (safe_get_full_optimizer_state(p, m) if _fragments(p) else state[p][m]).float()
                moments[f"{m}/{name}"] = _gather_tp(name, p, local, ctx).cpu()
        return weights, moments
    state = torch_optimizer(engine.optimizer).state
    for name, p in module.named_parameters():
        weights[name] = p.detach().float().cpu().clone()
        for m in MOMENTS if with_moments else ():
            if p in state and m in state[p]:
                moments[f"{m}/{name}"] = state[p][m].detach().float().cpu().clone()
    return weights, moments


def full_weights(engine: Engine) -> dict[str, Tensor]:
    """The single-device model's fp32 weights (for the export; a collective over all ranks)."""
    return gather_state(engine, with_moments=False)[0]


def load_state(engine: Engine, weights: dict[str, Tensor], moments: dict[str, Tensor], steps: int) -> None:
    """Put full fp32 weights and Adam moments (and Adam's step count) into this rank's layout."""
    ctx, module = engine.ctx, engine.module
    names = [n for n, _ in module.named_parameters()]
    missing = sorted(set(names) - set(weights))
    assert not missing, f"the checkpoint lacks {missing[:5]}"
    if engine.uses_deepspeed:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        _prime(engine)
        with engine.gathered(modify=True) as full:  # the module's own (possibly bf16) weights
            for name, p in full.named_parameters():
                p.data.copy_(_slice_tp(name, p, weights[name], ctx).to(p.dtype))
        state = torch_optimizer(engine.optimizer).state
        for name, p in module.named_parameters():
            fragments = _fragments(p)  # without: weights set above, moments the optimizer's own state
            safe_set_full_fp32_param(p, _slice_tp(name, p, weights[name], ctx).to(_device(p)))
            for m in MOMENTS:
                if f"{m}/{name}" in moments:
                    value = _slice_tp(name, p, moments[f"{m}/{name}"], ctx).to(_device(p))
                    if fragments:
                        safe_set_full_optimizer_state(p, value, m)
                    else:
                        state[p][m].copy_(value)
        zero: Any = getattr(engine.optimizer, "optimizer", None)
        if getattr(zero, "_hp_optimizer_states_linked", False):
            # The optimizer's first step may rebuild its state tensors: link the fragments again then.
            zero._hp_optimizer_states_linked = False
    else:
        basic = torch_optimizer(engine.optimizer)
        # torch's own rule (Optimizer.load_state_dict): fused and capturable Adam keep the step count
        # on the parameters' device, plain Adam on the CPU.
        on_device = any(g.get("fused") or g.get("capturable") for g in basic.param_groups)
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(weights[name].to(p.dtype))
                if f"exp_avg/{name}" in moments:
                    basic.state[p] = {
                        "step": torch.tensor(float(steps), device=p.device if on_device else "cpu"),
                        **{m: moments[f"{m}/{name}"].to(p.device, p.dtype, copy=True) for m in MOMENTS},
                    }
    _set_steps(engine, steps)


def _prime(engine: Engine) -> None:
    """Create Adam's state before the first step, so that it can be written: ZeRO-1/2 (and DeepSpeed's
    bf16 optimizer) create it lazily at the first step and only then link each parameter to its
    fragment of the flat partition. Zeros with step 0 are exactly what that first step would start
    from; the link is DeepSpeed's own."""
    basic = torch_optimizer(engine.optimizer)
    zero = getattr(engine.optimizer, "optimizer", None)
    tensors = [p for group in basic.param_groups for p in group["params"]]
    tensors += list(getattr(zero, "fp32_partitioned_groups_flat", []))  # ZeRO-3 swaps these in per step
    for p in tensors:
        if not basic.state.get(p):
            basic.state[p] = {"step": torch.tensor(0.0), **{m: torch.zeros_like(p) for m in MOMENTS}}
    link = getattr(zero, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()


def _fragments(p: Tensor) -> bool:
    """Whether DeepSpeed keeps ``p``'s fp32 master and moments as fragments of a flat partition (ZeRO
    1-3, bf16 optimizer). Without ZeRO, in fp32, the torch optimizer updates ``p`` itself: its values
    and its own optimizer state are the full tensors."""
    return hasattr(p, "ds_id") or hasattr(p, "_hp_mapping")


def _device(p: Tensor) -> torch.device:
    ds_tensor = getattr(p, "ds_tensor", None)
    return (ds_tensor if ds_tensor is not None else p).device


def _set_steps(engine: Engine, steps: int) -> None:
    for state in torch_optimizer(engine.optimizer).state.values():
        if "step" in state:
            old = state["step"]
            state["step"] = (
                torch.tensor(float(steps), dtype=old.dtype, device=old.device)
                if torch.is_tensor(old)
                else steps
            )
