"""The DeepSpeed config, generated: the launch file owns the layout, our config owns the training.

Ownership, so that no setting has two owners:
- the DeepSpeed file that the accelerate launch file names (``configs/deepspeed/*.json``, passed by
  ``accelerate launch`` as ``ACCELERATE_DEEPSPEED_CONFIG_FILE``) owns the memory layout: the ZeRO
  stage, offload, bucket sizes, and ``tensor_parallel.autotp_size``;
- ``tpe-train``'s config owns everything about the optimisation: the optimizer and its schedule
  (built in code, never in the JSON), gradient accumulation, clipping, bf16/fp16 and loss scaling,
  and the tensor-parallel partitioning of our modules.
A DeepSpeed file that sets one of ours to anything but ``"auto"`` is refused, naming the key and the
config key that owns it. The generated config is written into the run directory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpe_train.config import Config, ConfigError
from tpe_train.parallel.plan import PARTITION

#: DeepSpeed keys our config owns -> the config key that sets them.
OWNED = {
    "optimizer": "the optimizer built from train.lr / adam_* / weight_decay",
    "scheduler": "the inverse-sqrt schedule (train.lr, train.warmup_steps)",
    "gradient_accumulation_steps": "train.accumulate",
    "gradient_clipping": "train.clip_norm",
    "train_batch_size": "data.max_tokens and train.accumulate",
    "train_micro_batch_size_per_gpu": "data.max_tokens",
    "bf16": "train.bf16",
    "fp16": "train.fp16",
    "tensor_parallel.partition_config": "tpe_train.parallel.plan.PARTITION",
}


@dataclass(frozen=True)
class ProcessLayout:
    """How this run is laid out over processes, as the launcher asked."""

    world_size: int
    tp_size: int
    deepspeed: dict[str, Any] | None  # the launch file's DeepSpeed template (None: no DeepSpeed)
    source: str  # where the layout came from, for messages

    @property
    def zero_stage(self) -> int | None:
        if self.deepspeed is None:
            return None
        return int(self.deepspeed.get("zero_optimization", {}).get("stage", 0))

    @property
    def offload(self) -> bool:
        """Optimizer state kept in host memory (ZeRO offload)."""
        zero = (self.deepspeed or {}).get("zero_optimization", {})
        return zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None)


def launch_template() -> tuple[dict[str, Any] | None, str]:
    """The DeepSpeed template of this launch, from the environment ``accelerate launch`` sets."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return None, "no DeepSpeed in the launch"
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if path != "none":
        try:
            return json.loads(Path(path).read_text()), path
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(
                f"the DeepSpeed file {path} named by the accelerate launch file cannot be read ({err}); "
                "point deepspeed_config.deepspeed_config_file at a file like configs/deepspeed/zero2.json"
            ) from err
    # An accelerate file that lists the ZeRO settings itself (as ``accelerate config`` writes them).
    zero: dict[str, Any] = {"stage": int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))}
    for key, env in (("offload_optimizer", "OFFLOAD_OPTIMIZER"), ("offload_param", "OFFLOAD_PARAM")):
        device = os.environ.get(f"ACCELERATE_DEEPSPEED_{env}_DEVICE", "none")
        if device != "none":
            zero[key] = {"device": device}
    return {"zero_optimization": zero}, "the accelerate launch file's deepspeed_config"


def resolve_layout(cfg: Config, world_size: int | None = None) -> ProcessLayout:
    """The layout of this run, checked against the model before any work: a combination that
    cannot work is a ``ConfigError`` naming the keys and the fix."""
    template, source = launch_template()
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    file_tp = autotp_size(template)
    tp = cfg.parallel.tp_size or file_tp or 1
    if cfg.parallel.tp_size and file_tp and cfg.parallel.tp_size != file_tp:
        raise ConfigError(
            f"parallel.tp_size={cfg.parallel.tp_size} but {source} sets tensor_parallel.autotp_size="
            f"{file_tp}; set one of them (leave parallel.tp_size empty to take the launch file's)"
        )
    if template is not None:
        _check_owned(template, source)
    layout = ProcessLayout(world, tp, template, source)
    _check(cfg, layout)
    _check_compute(cfg, layout)
    return layout


def autotp_size(template: dict[str, Any] | None) -> int | None:
    """The tensor-parallel size a DeepSpeed file asks for (``tensor_parallel.autotp_size``); None: unset."""
    size = ((template or {}).get("tensor_parallel") or {}).get("autotp_size")
    return int(size) if isinstance(size, int) and size > 0 else None


def _check_owned(template: dict[str, Any], source: str) -> None:
    for dotted, owner in OWNED.items():
        node: Any = template
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None or node == "auto" or (isinstance(node, dict) and _all_auto(node)):
            continue
        raise ConfigError(
            f"{source} sets '{dotted}', which tpe-train's config owns ({owner}); remove it from the "
            'DeepSpeed file or set it to "auto", and set it through the tpe-train config instead'
        )


def _all_auto(node: dict[str, Any]) -> bool:
    return all(v == "auto" for v in node.values())


def _check(cfg: Config, layout: ProcessLayout) -> None:
    m, tp = cfg.model, layout.tp_size
    problems = []
    if layout.world_size % tp:
        problems.append(
            f"the launch has {layout.world_size} processes, not a multiple of the tensor-parallel size "
            f"{tp}; launch a multiple of {tp} processes"
        )
    if tp > 1:
        if layout.deepspeed is None:
            problems.append(
                f"tensor parallelism (size {tp}) runs through DeepSpeed AutoTP; launch with a DeepSpeed "
                "file such as configs/accelerate/cpu_tp2.yaml"
            )
        if m.n_heads % tp:
            problems.append(
                f"model.n_heads ({m.n_heads}) is not divisible by the tensor-parallel size ({tp}); "
                "each rank must own whole heads: choose n_heads or parallel.tp_size accordingly"
            )
        if m.ffn_dim % tp:
            problems.append(
                f"model.ffn_dim ({m.ffn_dim}) is not divisible by the tensor-parallel size ({tp}); "
                "choose ffn_dim or parallel.tp_size accordingly"
            )
        p = m.position
        if "learned" in (p.kind, p.encoder, p.decoder, p.cross) and p.max_positions % tp:
            problems.append(
                f"model.position.max_positions ({p.max_positions}) is not divisible by the "
                f"tensor-parallel size ({tp}); the learned table is split along positions: round it up"
            )
    if cfg.train.fp16 and layout.deepspeed is not None and not _has_gpu():
        problems.append(
            "train.fp16 under DeepSpeed needs GPUs (DeepSpeed's fp16 optimizer); on the CPU use "
            "train.bf16, or a launch without DeepSpeed (one process, or the cpu_ddp layout)"
        )
    if problems:
        raise ConfigError("impossible parallel layout: " + "; ".join(problems))


def _check_compute(cfg: Config, layout: ProcessLayout) -> None:
    """The attention backend and the compiled step against where the run lands."""
    if cfg.model.attention == "flex" and not _has_gpu():
        raise ConfigError(
            "model.attention=flex cannot train on the CPU: FlexAttention has no backward pass there "
            "(torch 2.13); set model.attention=auto (it takes sdpa on the CPU) or sdpa"
        )
    if cfg.train.compile and (layout.zero_stage == 3 or layout.tp_size > 1):
        what = "ZeRO-3" if layout.zero_stage == 3 else f"tensor parallelism (size {layout.tp_size})"
        raise ConfigError(
            f"train.compile=true does not work with {what} ({layout.source}): its hooks gather or "
            "all-reduce inside every layer, which torch.compile cannot trace; set train.compile=false, "
            "or train with DDP or DeepSpeed ZeRO-0/1/2"
        )


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def deepspeed_config(cfg: Config, layout: ProcessLayout) -> dict[str, Any]:
    """The full DeepSpeed config: the launch file's layout plus what our config owns."""
    assert layout.deepspeed is not None
    ds = json.loads(json.dumps(layout.deepspeed))  # a deep copy; "auto" values are replaced below
    for key in ("optimizer", "scheduler", "train_batch_size"):
        ds.pop(key, None)
    # train_batch_size is left to DeepSpeed (micro x accumulation x data-parallel ranks).
    ds.update(
        {
            # Batches are token-bucketed: one "micro batch" is one token batch per rank.
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": cfg.train.accumulate,
            "gradient_clipping": cfg.train.clip_norm,
            "bf16": {"enabled": cfg.train.bf16},
            "fp16": {
                "enabled": cfg.train.fp16,
                "loss_scale": 0,  # dynamic
                "initial_scale_power": cfg.train.loss_scale_power,
                "loss_scale_window": cfg.train.loss_scale_window,
            },
            "steps_per_print": 10**9,  # we log ourselves, on rank 0
            "wall_clock_breakdown": False,
            # Our optimizer is torch's AdamW, also under ZeRO and CPU offload.
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
        }
    )
    ds.setdefault("zero_optimization", {"stage": 0})
    if layout.tp_size > 1:
        ds["tensor_parallel"] = {**ds.get("tensor_parallel", {}), "autotp_size": layout.tp_size}
        ds["tensor_parallel"]["partition_config"] = PARTITION
    return ds
