"""Activation checkpointing, applied from outside the model (``train.activation_checkpointing``).

Like torchtitan's ``apply_ac``: the model stays single-device and knows nothing of it. The layers of
the encoder and decoder stacks (modules named ``encoder.layers.<i>`` / ``decoder.layers.<i>``, found
by pattern) get a forward that runs under ``torch.utils.checkpoint`` (non-reentrant) while gradients
are recorded: the backward reruns the layer's forward from its input instead of keeping every
intermediate activation. The RNG state is stashed and restored around the recomputation
(``preserve_rng_state``), so dropout draws the same masks and the gradients are those of the plain
step. The forward is set on the instance, not wrapped in a new module, so parameter names, state
dicts and checkpoints are unchanged; evaluation and decoding (no gradients, or a KV cache) run the
layer as it is.

It works under DDP, DeepSpeed ZeRO 0-3 (the recomputation calls the submodules again, so ZeRO-3's
hooks gather their parameters again) and AutoTP tensor parallelism (every rank recomputes the same
collectives in the same order): tests/test_activation_checkpointing.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

#: The layers a stack runs one after another: what checkpointing wraps.
LAYER = re.compile(r"^(?:.*\.)?(encoder|decoder)\.layers\.(\d+)$")
MODES = ("none", "layers", "every_n")


def checkpointed_layers(model: nn.Module, mode: str, every: int = 2) -> list[str]:
    """The names of the layers ``mode`` checkpoints: all of them (``layers``) or, in each stack, layer
    0 and every ``every``-th after it (``every_n``); none for ``none``."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing {mode!r} is none of {', '.join(MODES)}")
    names = []
    for name, _ in model.named_modules():
        m = LAYER.match(name)
        if m and mode != "none" and (mode == "layers" or int(m.group(2)) % every == 0):
            names.append(name)
    return names


def _state(values: list[Any]) -> list[tuple[Any, dict[str, Any]]]:
    """The attributes of the plain objects among a call's arguments (not tensors, not modules)."""
    return [
        (v, dict(vars(v)))
        for v in values
        if hasattr(v, "__dict__") and not isinstance(v, torch.Tensor | nn.Module)
    ]


def _checkpointed(forward: Callable[..., Any], module: nn.Module) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        cache = args[6] if len(args) > 6 else kwargs.get("cache")
        if not (module.training and torch.is_grad_enabled()) or cache is not None:
            return forward(*args, **kwargs)
        # The recomputation must see its arguments as the forward saw them: a stack's first layer
        # builds a mask that the others reuse (attention's dense mask of T5 and ALiBi, kept on the
        # ``Mask``); recomputed later, it would find it built and save fewer tensors.
        state = _state([*args, *kwargs.values()])

        def again(*a: Any, **kw: Any) -> Any:
            for obj, attrs in state:
                obj.__dict__.clear()
                obj.__dict__.update(attrs)
            return forward(*a, **kw)

        return checkpoint(again, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    return run


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 2) -> list[str]:
    """Checkpoint the layers that ``mode`` names (see ``checkpointed_layers``); returns their names.
    Applying it twice is refused: the recomputation would checkpoint again."""
    names = checkpointed_layers(model, mode, every)
    for name in names:
        layer = model.get_submodule(name)
        if "forward" in vars(layer):
            raise ValueError(f"{name} already has its own forward (checkpointed twice?)")
        layer.forward = _checkpointed(layer.forward, layer)
    return names
