"""Trainable parameters that get no gradient, named once at a run's first optimizer step.

A parameter the loss does not depend on (a module or table the forward never uses) gets no gradient:
torch's Adam then keeps no state for it and leaves it as it is, DeepSpeed's flat partitions hold zero
moments for it, and checkpoints save it as ``ckpt.holdings`` describes. Nothing breaks, but it is
usually a mistake in a model or an encoding, so the run says so once.

Each parameter gets a gradient hook for the first step only; a parameter counts as used when any rank
saw a gradient for it (one gather of the names, at that step).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

from torch import nn

from tpe_train.parallel.context import ParallelContext

log = logging.getLogger(__name__)


class GradlessWatch:
    """Watches the trainable parameters of ``module`` until ``report`` is called (every rank)."""

    def __init__(self, module: nn.Module, ctx: ParallelContext) -> None:
        self.ctx, self.seen = ctx, set[str]()
        self.names = [name for name, p in module.named_parameters() if p.requires_grad]
        self.handles = [
            p.register_hook(partial(self._saw, name))
            for name, p in module.named_parameters()
            if p.requires_grad
        ]

    def _saw(self, name: str, grad: Any) -> None:
        self.seen.add(name)

    def report(self, step: int) -> list[str]:
        """After the first optimizer step: stop watching; on rank 0, warn about the parameters no rank
        saw a gradient for. Returns them (later calls: nothing, at no cost)."""
        if not self.handles:
            return []
        for handle in self.handles:
            handle.remove()
        self.handles = []
        unseen = [name for name in self.names if name not in self.seen]
        if self.ctx.distributed:
            every = self.ctx.gather(unseen)
            unseen = [name for name in unseen if all(name in other for other in every)]
        if unseen and self.ctx.is_main:
            log.warning(
                "no gradient at step %d for the trainable parameter(s) %s: the loss does not depend on "
                "them (a module or table that the forward never uses). Their optimizer state stays absent "
                "(zeros under DeepSpeed), and checkpoints, reshards, averages and exports save them as they "
                "are. Use them in the forward, or remove them from the model, if that is not intended",
                step,
                ", ".join(unseen),
            )
        return unseen
