"""A gradient check that can fail for the right reason: a model's gradients against an fp64 reference.

Each tensor's error is measured relative to that tensor's own gradient norm, ``|g - g_ref| / |g_ref|``,
so a small tensor (a position table, a bias) is held to the same standard as a large one, and an
error in it is not hidden by a larger tensor elsewhere. The exception: tensors whose exact gradient is
zero. A key projection's bias adds one constant to all of a query's scores, which the softmax
cancels, so its exact gradient is 0 and any computed one is rounding noise; relative to its own
(zero) norm that noise is arbitrarily large. Those tensors (recognised by an fp64 reference gradient
below ``ZERO`` times the global scale) are checked against the global gradient scale instead: the
root mean square of all reference gradients, per element.

``tests/test_gradcheck.py`` shows that the check passes correct code and catches planted bugs (a wrong
sign, an off-by-one relative distance); ``benchmarks/gpu/attention.py`` runs it on a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: a reference gradient below ZERO x (global RMS x sqrt(numel)) is taken as exactly zero
ZERO = 1e-9


@dataclass(frozen=True)
class TensorError:
    name: str
    error: float  # relative to the tensor's own norm, or (exact gradient 0) to the global scale
    against: str  # "own" or "global"


def gradients(
    model: nn.Module,
    src: Tensor,
    tgt_in: Tensor,
    tgt_out: Tensor,
    pad_id: int = 0,
    smoothing: float = 0.1,
    embed: nn.Module | None = None,
) -> dict[str, Tensor]:
    """fp64 CPU copies of the gradients of a summed label-smoothed loss (plain ``F.cross_entropy``,
    in the logits' dtype) w.r.t. every parameter and, if ``embed`` (the embedding module) is given,
    to each of its outputs (``input:0``, ``input:1``: the stacks' inputs). ``model(src, tgt_in)``
    gives the logits; training mode, so dropout must be 0 for a deterministic comparison."""
    inputs: list[Tensor] = []

    def keep(module: Any, args: Any, out: Tensor) -> None:
        out.retain_grad()
        inputs.append(out)

    handle = embed.register_forward_hook(keep) if embed is not None else None
    model.zero_grad(set_to_none=True)
    model.train()
    try:
        logits = model(src, tgt_in)
        flat = logits.reshape(-1, logits.shape[-1])
        target = tgt_out.reshape(-1)
        loss = F.cross_entropy(flat, target, ignore_index=pad_id, label_smoothing=smoothing, reduction="sum")
        (loss / (target != pad_id).sum()).backward()
    finally:
        if handle is not None:
            handle.remove()
    out = {f"input:{i}": t.grad for i, t in enumerate(inputs)}
    out.update({name: p.grad for name, p in model.named_parameters()})
    return {k: v.detach().to("cpu", torch.float64) for k, v in out.items() if v is not None}


def compare(got: dict[str, Tensor], ref: dict[str, Tensor]) -> list[TensorError]:
    """Each tensor's error, worst first (see the module's docstring)."""
    if got.keys() != ref.keys():
        raise ValueError(f"the gradients name different tensors: {sorted(set(got) ^ set(ref))}")
    total = sum(float(r.double().pow(2).sum()) for r in ref.values())
    count = sum(r.numel() for r in ref.values())
    rms = math.sqrt(total / max(count, 1))
    errors = []
    for name, r in ref.items():
        r64, g64 = r.double(), got[name].double()
        norm, diff = float(r64.norm()), float((g64 - r64).norm())
        floor = rms * math.sqrt(r.numel())  # the norm of a tensor of this size at the global scale
        if norm <= ZERO * floor:
            errors.append(TensorError(name, diff / max(floor, 1e-300), "global"))
        else:
            errors.append(TensorError(name, diff / norm, "own"))
    return sorted(errors, key=lambda e: -e.error)


def check(
    got: dict[str, Tensor], ref: dict[str, Tensor], tol: float, zero_tol: float | None = None
) -> tuple[bool, list[TensorError]]:
    """(every tensor within tolerance, the errors worst first): ``tol`` relative to a tensor's own
    norm, ``zero_tol`` (default ``tol``) relative to the global scale for exactly-zero gradients."""
    errors = compare(got, ref)
    limit: Callable[[TensorError], float] = lambda e: tol if e.against == "own" else (zero_tol or tol)  # noqa: E731
    return all(e.error <= limit(e) for e in errors), errors
