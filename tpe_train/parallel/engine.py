"""One training engine for every layout: one process, plain data parallelism (torch DDP), or DeepSpeed
(ZeRO 0-3, offload, AutoTP, prepared by accelerate).

The loop sees three verbs: ``forward``, ``backward`` (per micro-batch) and ``step`` (returns the
gradient norm); ``ckpt.holdings`` says which regions of the single-device state each rank holds.
Under DeepSpeed the engine clips and steps inside the last ``backward`` of an optimizer step, as
accelerate drives it; under plain torch, ``step`` clips and steps.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from tpe_train.config import ConfigError
from tpe_train.parallel.context import ParallelContext

log = logging.getLogger(__name__)

#: torch DDP's error at the forward after a step in which a parameter got no gradient unlooked-for
UNREDUCED = "Expected to have finished reduction in the prior iteration"
UNUSED_LATER = (
    "plain data parallelism (torch DDP): a trainable parameter got no gradient in the last step, though "
    "every parameter got one in the first step, so DDP stopped searching for parameters without a "
    "gradient (parallel.find_unused=first_step) and could not average the gradients of that step. The "
    "model uses different parameters in different steps (a module only some batches reach). Set "
    "parallel.find_unused=always, which searches in every step, or train under DeepSpeed "
    "(configs/accelerate/cpu_zero2.yaml and its GPU twins), and resume from a checkpoint saved before "
    "that last step (which updated each rank with its own gradients; the earlier ones are whole)."
)


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under accelerate's and DeepSpeed's wrappers (each keeps it in ``.optimizer``)."""
    while not (
        isinstance(optimizer, torch.optim.Optimizer) and type(optimizer).__module__.startswith("torch")
    ):
        optimizer = optimizer.optimizer
    return optimizer


class Engine:
    """The prepared model, optimizer and schedule of one rank."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        ctx: ParallelContext,
        *,
        accumulate: int,
        clip_norm: float,
        deepspeed: dict[str, Any] | None,
        loss_scale: float | None = None,
        scale_window: int = 1000,
        find_unused: str = "first_step",
    ) -> None:
        """``loss_scale``: fp16 on a plain engine, the first scale of torch's dynamic loss scaling,
        doubled after ``scale_window`` steps without an overflow (under DeepSpeed, its config's
        ``fp16`` section does this)."""
        self.ctx, self.accumulate, self.clip_norm = ctx, accumulate, clip_norm
        self.uses_deepspeed = deepspeed is not None
        self._micro = 0
        self.accelerator: Any = None
        self.model: Any  # nn.Module, DistributedDataParallel or a DeepSpeed engine
        self.ddp = deepspeed is None and ctx.distributed
        self.search_always = find_unused == "always"  # DDP: look for gradless parameters in every step
        self.scaler: torch.amp.GradScaler | None = None
        if loss_scale is not None:
            assert deepspeed is None, "under DeepSpeed, fp16 loss scaling is DeepSpeed's"
            self.scaler = torch.amp.GradScaler(
                ctx.device.type, init_scale=loss_scale, growth_interval=scale_window
            )
        if deepspeed is None:
            # One process: no wrapper at all. Plain data parallelism: torch's DDP over the data-parallel
            # group, wrapped here rather than by accelerate, whose state reads a CPU launch of
            # `accelerate launch` (distributed_type MULTI_GPU + use_cpu, started by torchrun) as not
            # distributed at all (accelerate 1.15: DistributedType.NO): every rank then trained alone.
            # DDP expects a gradient for every parameter unless told to look for the missing ones
            # (find_unused_parameters, a walk of the autograd graph in every backward); it looks during
            # the first step, and ``settle`` drops the search when every parameter got a gradient
            # (``find_unused="always"``: it never does).
            if self.ddp:
                model = self._ddp(model, find_unused=True)
            self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
            return
        from accelerate import Accelerator
        from accelerate.utils import DeepSpeedPlugin

        self.accelerator = Accelerator(
            deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=deepspeed),
            gradient_accumulation_steps=accumulate,
            mixed_precision="no",  # bf16: autocast in the loop, or DeepSpeed's own bf16 weights
            step_scheduler_with_optimizer=False,
        )
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        if self.zero3:
            _register_external(self.module)
            _separate_projections(self.module)
        share_fp32_master(self.optimizer)
        _record_stage0_norm(self.model)

    def _ddp(self, model: nn.Module, find_unused: bool) -> nn.parallel.DistributedDataParallel:
        ctx = self.ctx
        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(
            model, device_ids=ids, process_group=ctx.dp_group, find_unused_parameters=find_unused
        )

    def settle(self, gradless: list[str]) -> None:
        """After the first optimizer step of this process, with the trainable parameters that got no
        gradient on any rank (``train.gradless``): plain DDP stops looking for them when there are none
        (wrapped again, between steps, without ``find_unused_parameters``); with some, it keeps looking,
        so that their absence from the gradient reduction is expected. Other engines: nothing to do."""
        if self.ddp and not gradless and not self.search_always and self.model.find_unused_parameters:
            self.model = self._ddp(self.model.module, find_unused=False)

    @property
    def module(self) -> nn.Module:
        """The model without wrappers (its parameters may be sharded)."""
        if self.ddp:
            return self.model.module
        if self.accelerator is None:
            return self.model
        return self.accelerator.unwrap_model(self.model)

    @property
    def zero3(self) -> bool:
        return self.uses_deepspeed and self.model.zero_optimization_stage() == 3

    def forward(self, *args: Tensor) -> Tensor:
        if self.ddp and torch.is_grad_enabled():  # DDP's no_sync, for every micro-batch but the last
            self.model.require_backward_grad_sync = self._micro + 1 == self.accumulate
            try:
                return self.model(*args)
            except RuntimeError as err:
                if UNREDUCED not in str(err):
                    raise
                log.error("%s", UNUSED_LATER)  # from the rank that finds it, which may not be rank 0
                refused = ConfigError(UNUSED_LATER)
                refused.reported = True  # type: ignore[attr-defined]
                raise refused from err
        return self.model(*args)

    def backward(self, loss: Tensor) -> None:
        """Backward of one micro-batch. ``loss`` is already normalised for the whole optimizer step
        (see ``step.train_step``); accelerate and DeepSpeed divide it by ``accumulate`` again,
        which the caller compensates."""
        self._micro += 1
        if self.accelerator is None:  # DDP averages the gradients over the ranks in the last backward
            loss = loss / self.accumulate
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            return
        with self.accelerator.accumulate(self.model):
            self.accelerator.backward(loss)

    def step(self) -> Tensor | float:
        """Finish the optimizer step after ``accumulate`` backward calls; returns the gradient norm
        (before clipping) over all ranks: a tensor on the device (not read back here: on a GPU that
        would wait for the step), or the float DeepSpeed hands back (nan when it has none)."""
        assert self._micro == self.accumulate, f"{self._micro} backward calls, expected {self.accumulate}"
        self._micro = 0
        if self.uses_deepspeed:  # DeepSpeed clipped, stepped and zeroed in the last backward
            # accelerate hands our schedule to DeepSpeed or, when DeepSpeed does not take it, wraps it
            # in a scheduler that must be stepped here (the DeepSpeed wrapper's step is a no-op)
            self.scheduler.step()
            norm = self.model.get_global_grad_norm()
            return norm if norm is not None else float("nan")
        max_norm = self.clip_norm or float("inf")
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # on the device; an overflow leaves inf or nan in a gradient
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)  # DDP or one process
        if self.scaler is not None:
            # The fused optimizer takes the overflow flag as a tensor and skips the update on the
            # device: no read back (torch's GradScaler reads it back for other optimizers). The
            # schedule advances either way: the host does not know.
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def loss_scale_state(self) -> dict[str, float] | None:
        """The dynamic fp16 loss scale (torch's or DeepSpeed's) as checkpoints keep it; None without
        fp16. DeepSpeed's keys, torch's growth tracker added: either engine resumes from either's."""
        if self.scaler is not None:
            state = self.scaler.state_dict()  # reads the scale back: at checkpoints only
            return {"cur_scale": float(state["scale"]), "growth_tracker": float(state["_growth_tracker"])}
        scaler = getattr(getattr(self.model, "optimizer", None), "loss_scaler", None)
        if scaler is None:
            return None
        keys = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
        return {k: float(getattr(scaler, k)) for k in keys if hasattr(scaler, k)}

    def load_loss_scale_state(self, state: dict[str, float] | None) -> None:
        """Restore what ``loss_scale_state`` gave (nothing to do without fp16, or when none was kept)."""
        if not state:
            return
        if self.scaler is not None:
            growth = int(state.get("growth_tracker", 0))  # absent in DeepSpeed's
            self.scaler.load_state_dict(
                {**self.scaler.state_dict(), "scale": state["cur_scale"], "_growth_tracker": growth}
            )
            return
        scaler = getattr(getattr(self.model, "optimizer", None), "loss_scaler", None)
        if scaler is None:
            return
        for key, value in state.items():
            if hasattr(scaler, key):
                old = getattr(scaler, key)
                setattr(scaler, key, type(old)(value) if not torch.is_tensor(old) else torch.tensor(value))

    def lr(self) -> float:
        return float(self.lr_scheduler.get_last_lr()[0])

    @property
    def lr_scheduler(self) -> Any:
        """The torch scheduler under accelerate's wrapper."""
        return getattr(self.scheduler, "scheduler", self.scheduler)

    def set_lr(self, lrs: list[float]) -> None:
        """Set the optimizer's learning rates (after a scheduler state is restored)."""
        for group, lr in zip(torch_optimizer(self.optimizer).param_groups, lrs, strict=True):
            group["lr"] = lr

    @contextlib.contextmanager
    def gathered(self, modify: bool = False) -> Iterator[nn.Module]:
        """The model with every parameter present on this rank (ZeRO-3 gathers them for the block;
        tensor-parallel shards stay sharded: all ranks of a TP group must run the block together).
        ``modify``: changes made in the block are kept (every rank must make the same ones)."""
        module = self.module
        if self.zero3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(
                list(module.parameters()), modifier_rank=0 if modify else None
            ):
                yield module
        else:
            yield module


def share_fp32_master(optimizer: Any) -> int:
    """In fp32 training, let ZeRO's fp32 master partition be the parameter partition itself.

    ZeRO keeps a flat fp32 copy of each rank's partition for the optimizer to update, then copies it
    into the (bf16/fp16) model weights. When the weights are fp32 already, that copy holds the same
    numbers: a third more parameter + optimizer memory for nothing. ZeRO-3 shares the storage itself
    in that case but misses it when its device names differ (``"cpu"`` against ``cpu``), and ZeRO-1/2
    never do. Here the master partition takes the weight partition's storage (same dtype and device,
    no offload): the optimizer then updates the weights in place and DeepSpeed's copy back becomes a
    copy onto itself. The trajectory tests check that results are unchanged. Returns the bytes saved.
    """
    zero = getattr(optimizer, "optimizer", optimizer)
    pairs: list[tuple[Tensor, Tensor]] = []
    if hasattr(zero, "fp32_partitioned_groups_flat") and not getattr(zero, "offload_optimizer", True):
        pairs = list(zip(zero.fp32_partitioned_groups_flat, zero.fp16_partitioned_groups_flat, strict=True))
    elif hasattr(zero, "single_partition_of_fp32_groups") and not getattr(zero, "cpu_offload", True):
        import torch.distributed as dist

        for i, master in enumerate(zero.single_partition_of_fp32_groups):
            rank = dist.get_rank(group=zero.real_dp_process_group[i])
            pairs.append((master, zero.parallel_partitioned_bit16_groups[i][rank]))
    saved = 0
    for master, weights in pairs:
        same_kind = (master.dtype, master.device, master.shape) == (
            weights.dtype,
            weights.device,
            weights.shape,
        )
        if same_kind and master.data_ptr() != weights.data_ptr():
            saved += master.numel() * master.element_size()
            master.data = weights.data
    if saved and hasattr(zero, "single_partition_of_fp32_groups"):
        zero._link_all_hp_params()  # ZeRO-1/2 keep views of the master per parameter: point them anew
    return saved


def _record_stage0_norm(engine: Any) -> None:
    """Without ZeRO, DeepSpeed computes the gradient norm to clip (its own TP-aware ``clip_grad_norm_``)
    and drops it, so ``get_global_grad_norm()`` is None. Keep it, as the ZeRO optimizers do."""
    if engine.zero_optimization_stage() != 0 or not hasattr(engine, "clip_fp32_gradients"):
        return
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_and_record() -> None:
        limit, params = engine.gradient_clipping(), engine.module.parameters()
        engine._global_grad_norm = clip_grad_norm_(params, max_norm=limit, mpu=engine.mpu)

    engine.clip_fp32_gradients = clip_and_record


def _register_external(module: nn.Module) -> None:
    """ZeRO-3 gathers a module's parameters when that module's forward runs. The shared embedding is
    also the output layer, and the position tables are read inside attention: both are used outside
    their owner's forward, so they are registered with the root module, whose forward spans them."""
    import deepspeed

    for name, param in module.named_parameters():
        if name == "embed.weight" or ".positions." in name or "cross_positions." in name:
            deepspeed.zero.register_external_parameter(module, param)


def _separate_projections(module: nn.Module) -> None:
    """ZeRO-3 gathers a projection's weight only while its own forward runs: attention computes q, k
    and v as separate products there, not as one over their concatenated weights."""
    for sub in module.modules():
        if hasattr(sub, "fuse_projections"):
            setattr(sub, "fuse_projections", False)  # noqa: B010 (parallel/ never imports the model)
