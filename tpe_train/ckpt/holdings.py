"""What this rank holds of the single-device training state, as regions of global tensors.

A checkpoint stores the fp32 weights and Adam moments of the single-device model under the
parameter's name (``<name>``, ``exp_avg/<name>``, ``exp_avg_sq/<name>``), each rank writing and
reading only what it holds (``ckpt.shards`` describes regions and files). A parameter that never got
a gradient has no state in torch's Adam: its moments are then absent from the checkpoint, and stay
absent on a load into torch's Adam; DeepSpeed's flat partitions hold zeros for it, which is also what
a load into them puts where the checkpoint has none.

- ZeRO-1/2 (and DeepSpeed's bf16 optimizer): the fragment of each parameter that lies in this rank's
  flat fp32 partition, from DeepSpeed's fragment mapping (``_hp_mapping``: where in the parameter the
  fragment starts, and views of the fp32 master and of the moments). The module's own weights are
  whole on every rank: a load fills them whole (in their own dtype).
- ZeRO-3: each parameter's own partition, through DeepSpeed's local API
  (``safe_get_local_fp32_param`` / ``safe_get_local_optimizer_state`` and their ``safe_set_local_``
  twins); rank r of the parameter's group holds elements ``[r * n, (r + 1) * n)`` of its flattening.
- Without ZeRO: the whole tensors, which every data-parallel rank holds alike.

A tensor-parallel slice is a block of the global tensor along ``plan.split_dim``; a parameter that
tensor parallelism does not split is the same on every rank of the group. Ranks that hold the very
same elements share the writing of them (``Holding.replicas``), so every element is written once.
Nothing here gathers: no collective, and no memory beyond views of what the rank already holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from tpe_train.ckpt.shards import Piece, Region
from tpe_train.parallel.context import ParallelContext
from tpe_train.parallel.engine import Engine, torch_optimizer
from tpe_train.parallel.plan import split_dim

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class Holding:
    """A region of one global tensor that this rank holds, and its values (1-D, ``region.numel``)."""

    region: Region
    data: Tensor  # a view of the live state where there is one (a load writes into it)
    replicas: int = 1  # ranks holding the very same region; they share the writing
    replica: int = 0
    commit: Callable[[], None] | None = None  # after a load: push ``data`` to where it lives

    def piece(self) -> Piece:
        """What this rank writes of the region: its share among the replicas."""
        part = self.region.part(self.replica, self.replicas)
        lo, hi = part.start - self.region.start, part.stop - self.region.start
        return Piece(part, self.data[lo:hi])


def adam_steps(engine: Engine) -> int:
    """Optimizer steps Adam has taken (its bias correction depends on it): the most of any parameter's
    (one that gets no gradient keeps the count its state was loaded with)."""
    steps = [state.get("step") for state in torch_optimizer(engine.optimizer).state.values()]
    return max((int(step) for step in steps if step is not None), default=0)


def holdings(engine: Engine, moments: bool, load: bool = False) -> list[Holding]:
    """Everything this rank holds of the weights (and Adam's moments). ``load``: what a load fills,
    which under ZeRO-1/2 also includes the module's own weights, whole on every rank."""
    ctx, out = engine.ctx, []
    state = torch_optimizer(engine.optimizer).state
    for name, p in engine.module.named_parameters():
        local = tuple(getattr(p, "ds_shape", p.shape))  # ZeRO-3: the shape before partitioning
        dim = split_dim(name, p) if ctx.tp_size > 1 else None
        shape, offsets = _block(local, dim, ctx)
        split = dim is not None
        names = [name, *(f"{m}/{name}" for m in MOMENTS if moments)]
        if hasattr(p, "ds_id"):  # ZeRO-3
            out += _zero3(p, names, shape, offsets, local, ctx, split)
        elif hasattr(p, "_hp_mapping"):  # ZeRO-1/2, bf16 optimizer
            mapping = p._hp_mapping
            if load:  # the module's weights, whole on every rank
                out.append(Holding(Region(name, shape, offsets, local, 0, p.numel()), p.data.view(-1)))
            if mapping is None:  # no fragment of this parameter in this rank's partition
                continue
            start = mapping.lp_fragment_address.start
            for key, full in zip([None, *MOMENTS], names, strict=False):
                data = mapping.get_hp_fragment(key)
                if load and key is None and _same_memory(data, p):
                    continue  # fp32 training: the master fragment is part of the weights just filled
                region = Region(full, shape, offsets, local, start, start + data.numel())
                out.append(Holding(region, data, *_tp_replicas(ctx, split)))
        else:  # the whole tensors, alike on every data-parallel rank
            replicas, replica = _tp_replicas(ctx, split)
            if not state.get(p):  # never a gradient: torch's Adam holds no state for it
                names = names[:1]
            for key, full in zip([None, *MOMENTS], names, strict=False):
                data = p.data if key is None else state[p][key]
                region = Region(full, shape, offsets, local, 0, p.numel())
                out.append(
                    Holding(region, data.view(-1), replicas * ctx.dp_size, ctx.dp_rank * replicas + replica)
                )
    return out


def _block(
    local: tuple[int, ...], dim: int | None, ctx: ParallelContext
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Global shape and offsets of a tensor-parallel slice of shape ``local`` (equal slices)."""
    if dim is None:
        return local, (0,) * len(local)
    shape = tuple(n * ctx.tp_size if d == dim else n for d, n in enumerate(local))
    offsets = tuple(ctx.tp_rank * n if d == dim else 0 for d, n in enumerate(local))
    return shape, offsets


def _tp_replicas(ctx: ParallelContext, split: bool) -> tuple[int, int]:
    """A tensor that tensor parallelism does not split is held alike by every rank of the group."""
    return (1, 0) if split else (ctx.tp_size, ctx.tp_rank)


def _same_memory(fragment: Tensor, p: Tensor) -> bool:
    """Whether the fp32 master fragment lives in the module's weights (``engine.share_fp32_master``)."""
    return bool(fragment.untyped_storage().data_ptr() == p.untyped_storage().data_ptr())


def _zero3(p: Any, names: list[str], shape: tuple[int, ...], offsets: tuple[int, ...], local: tuple[int, ...],
           ctx: ParallelContext, split: bool) -> list[Holding]:  # fmt: skip
    from deepspeed.utils import (
        safe_get_local_fp32_param,
        safe_get_local_optimizer_state,
        safe_set_local_fp32_param,
        safe_set_local_optimizer_state,
    )

    size = int(p.ds_tensor.ds_numel)
    start = dist.get_rank(group=p.ds_process_group) * size
    count = min(size, int(p.ds_numel) - start)  # the last partitions are padded
    if count <= 0:
        return []
    out = []
    for key, full in zip([None, *MOMENTS], names, strict=False):
        partition = safe_get_local_fp32_param(p) if key is None else safe_get_local_optimizer_state(p, key)

        def commit(partition: Tensor = partition, key: str | None = key) -> None:
            if key is None:
                safe_set_local_fp32_param(p, partition)
            else:
                safe_set_local_optimizer_state(p, partition, key)

        region = Region(full, shape, offsets, local, start, start + count)
        out.append(Holding(region, partition.view(-1)[:count], *_tp_replicas(ctx, split), commit=commit))
    return out


def before_load(engine: Engine, steps: int, stored: set[str]) -> None:
    """Make the optimizer state exist where a load will write it; ``stored``: the checkpoint's tensors.
    Torch's Adam gets state only for the parameters whose moments are stored (a parameter that never
    got a gradient has none, as in an uninterrupted run)."""
    if engine.uses_deepspeed:
        _prime(engine)
        if engine.zero3:
            engine.model.optimizer.checkpoint_event_prologue()  # every parameter back to its partition
        return
    basic = torch_optimizer(engine.optimizer)
    # torch's own rule (Optimizer.load_state_dict): fused and capturable Adam keep the step count on
    # the parameters' device, plain Adam on the CPU.
    on_device = any(g.get("fused") or g.get("capturable") for g in basic.param_groups)
    for name, p in engine.module.named_parameters():
        if steps > 0 and not basic.state.get(p) and f"{MOMENTS[0]}/{name}" in stored:
            step = torch.tensor(float(steps), device=p.device if on_device else "cpu")
            basic.state[p] = {"step": step, **{m: torch.zeros_like(p) for m in MOMENTS}}


def after_load(engine: Engine, loaded: list[Holding], steps: int) -> None:
    """Push what was read to where it lives, and derive the module's weights from the fp32 master."""
    for holding in loaded:
        if holding.commit is not None:
            holding.commit()
    zero: Any = getattr(engine.optimizer, "optimizer", None)
    if engine.zero3:
        # DeepSpeed's own order after a load (stage3._rigid_load_state_dict): the module's partitions
        # from the fp32 ones (one storage in fp32 training), then the persistent parameters gathered.
        for fp32, low in zip(
            zero.fp32_partitioned_groups_flat, zero.fp16_partitioned_groups_flat, strict=True
        ):
            if fp32.numel() and fp32.data_ptr() != low.data_ptr():
                low.data.copy_(fp32.data)
        zero.checkpoint_event_epilogue()
    if getattr(zero, "_hp_optimizer_states_linked", False):
        # The optimizer's first step may rebuild its state tensors: link the fragments again then.
        zero._hp_optimizer_states_linked = False
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


def _set_steps(engine: Engine, steps: int) -> None:
    for state in torch_optimizer(engine.optimizer).state.values():
        if "step" in state:
            old = state["step"]
            state["step"] = (
                torch.tensor(float(steps), dtype=old.dtype, device=old.device)
                if torch.is_tensor(old)
                else steps
            )
