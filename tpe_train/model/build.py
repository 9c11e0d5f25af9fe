"""The one place a ``Transformer`` is built: from its arguments, optionally seeded and moved."""

from __future__ import annotations

import torch

from tpe_train.model.args import ModelArgs
from tpe_train.model.transformer import Transformer


def build_model(
    args: ModelArgs, device: torch.device | str | None = None, seed: int | None = None
) -> Transformer:
    """The model ``args`` describe: initialised from torch's generator (seeded first with ``seed``) on
    the default device, then moved to ``device`` (None: left there; under ``torch.device("meta")``: shapes
    only)."""
    if seed is not None:
        torch.manual_seed(seed)
    model = Transformer(args)
    return model if device is None else model.to(device)
