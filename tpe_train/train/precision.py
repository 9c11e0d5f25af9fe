"""The precision policy: the dtype the forward passes autocast to, the dtype whose GEMM peak MFU is
measured against, and the start-up warning for bf16 on a GPU without bf16 units."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from tpe_train.config import Config, TrainConfig


def compute_dtype(train: TrainConfig) -> torch.dtype:
    """The dtype the products of a step run in: bf16 or fp16 as ``train.bf16``/``train.fp16`` ask,
    else fp32 (under DeepSpeed the weights themselves are in it)."""
    return torch.bfloat16 if train.bf16 else torch.float16 if train.fp16 else torch.float32


def autocast_dtype(cfg: Config, deepspeed: bool) -> torch.dtype | None:
    """The autocast dtype of the forward passes: bf16 or fp16 as ``train.bf16``/``train.fp16`` ask,
    None for fp32 and under DeepSpeed, which holds the weights in that precision itself."""
    dtype = compute_dtype(cfg.train)
    return None if deepspeed or dtype == torch.float32 else dtype


def precision_warning(cfg: Config, device: torch.device) -> str | None:
    """A start-up warning for ``train.bf16`` on a GPU without bf16 units (compute capability below 8.0:
    V100, T4): autocast then emulates bf16, slower than fp32, where fp16 has the GPU's tensor cores."""
    if not cfg.train.bf16 or device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if major >= 8:
        return None
    return (
        f"train.bf16 on {torch.cuda.get_device_name(device)} (compute capability {major}.{minor}), which "
        "has no bf16 units: bf16 runs emulated, slower than fp32; this GPU's mixed precision is "
        "train.fp16=true (train.bf16=false)"
    )


def autocast(amp_dtype: torch.dtype | None, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Autocast to ``amp_dtype`` on ``device``'s type; nothing for None."""
    if amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=amp_dtype)
