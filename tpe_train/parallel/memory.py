"""Per-rank memory report: bytes of parameters, gradients and optimizer state, and of the position tables.

Counted from the tensors each rank really holds after ``accelerate.prepare``: a ZeRO-3 parameter
counts its partition, the optimizer counts the tensors it updates (fp32 master partitions under ZeRO
and bf16, the parameters themselves otherwise) times three (master + Adam's two moments, unless the
master is the parameter itself). Gradients: full-size on every rank up to ZeRO-1, partitioned from
ZeRO-2 on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from tpe_train.parallel.deepspeed import ProcessLayout
from tpe_train.parallel.plan import local_numel, position_bytes

ADAM_MOMENTS = 2


@dataclass(frozen=True)
class MemoryReport:
    """Bytes one rank holds."""

    rank: int
    parameters: int
    gradients: int
    optimizer: int
    positions: int
    offloaded: bool  # optimizer state lives in host memory (ZeRO offload)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        where = " (offloaded to CPU)" if self.offloaded else ""
        return (
            f"rank {self.rank}: parameters {_mb(self.parameters)}, gradients {_mb(self.gradients)}, "
            f"optimizer state {_mb(self.optimizer)}{where}, position tables {self.positions:,} B"
        )


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def memory_report(model: nn.Module, optimizer: Any, rank: int, layout: ProcessLayout | None) -> MemoryReport:
    """What rank ``rank`` holds once ``accelerate.prepare`` has laid the model out (``layout``: the
    launch's layout; None for one plain process)."""
    zero_stage = layout.zero_stage if layout is not None else None
    params = list(model.parameters())
    param_bytes = sum(local_numel(p) * p.element_size() for p in params)
    updated = _updated_tensors(optimizer)
    weights = {_storage(p) for p in params}
    updated_bytes = sum(p.numel() * 4 for p in updated)  # Adam keeps fp32 state
    # The updated tensors are a separate master copy unless they are the weights' own storage.
    master = sum(t.numel() * t.element_size() for t in updated if _storage(t) not in weights)
    if (zero_stage or 0) >= 2:
        grad_bytes = updated_bytes
    else:
        grad_bytes = sum(local_numel(p) * p.element_size() for p in params if p.requires_grad)
    return MemoryReport(
        rank=rank,
        parameters=param_bytes,
        gradients=grad_bytes,
        optimizer=master + ADAM_MOMENTS * updated_bytes,
        positions=position_bytes(model),
        offloaded=layout.offload if layout is not None else False,
    )


def _storage(t: torch.Tensor) -> int:
    ds_tensor = getattr(t, "ds_tensor", None)  # a ZeRO-3 parameter's own partition
    return int((ds_tensor if ds_tensor is not None else t).untyped_storage().data_ptr())


#: where DeepSpeed's optimizers keep the fp32 tensors the torch optimizer updates (ZeRO-3 swaps them
#: into the torch optimizer's param groups only during its step)
_FP32_ATTRS = (
    "fp32_partitioned_groups_flat",
    "single_partition_of_fp32_groups",
    "fp32_groups_flat_partition",
)


def _updated_tensors(optimizer: Any) -> list[torch.Tensor]:
    node, depth = optimizer, 0
    while node is not None and depth < 8:
        for attr in _FP32_ATTRS:
            tensors = getattr(node, attr, None)
            if tensors:
                return [t for t in tensors if isinstance(t, torch.Tensor)]
        if isinstance(node, torch.optim.Optimizer) and type(node).__module__.startswith("torch"):
            return [p for group in node.param_groups for p in group["params"]]
        node, depth = getattr(node, "optimizer", None), depth + 1
    raise AssertionError("no optimizer found under the wrappers")
