"""What a saved config means where it lacks a key that was added later.

A checkpoint, an export or a run directory keeps the config it was written with. A key added since
then is absent there; for most keys the default is what the older code did, but where a new key's
default changed the behaviour (``model.position.cope_divide``: CoPE's term was added undivided before
the key existed), the absent key means the old behaviour. ``fill`` completes a saved config with those
values before it is validated, so an older CoPE export evaluates as it was trained; ``matters`` says
whether such a key acts on a given model, so resuming an older checkpoint of another encoding is not
refused over a key that encoding never reads.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

#: (section path, key) -> (the value an absent key means, whether the key acts on a model's position
#: section: a function of that section as a mapping)
ADDED: dict[tuple[tuple[str, ...], str], tuple[Any, Callable[[dict[str, Any]], bool]]] = {
    (("model", "position"), "cope_divide"): (
        False,
        lambda p: "cope" in (p.get("kind"), p.get("cross")),
    ),
    (("model", "position"), "randomized_per_layer"): (
        False,
        lambda p: p.get("augment") == "randomized" and p.get("kind") == "rope",
    ),
    (("model", "position"), "randomized_test"): (
        False,
        lambda p: p.get("augment") == "randomized",
    ),
}


def _section(data: Any, path: tuple[str, ...]) -> dict[str, Any] | None:
    for name in path:
        data = data.get(name) if isinstance(data, dict) else None
    return data if isinstance(data, dict) else None


def fill(saved: Any) -> Any:
    """``saved`` (a config as read from YAML) with every later-added key it lacks set to what its
    absence means; anything that is not a mapping is returned as it is (validation names it)."""
    if not isinstance(saved, dict):
        return saved
    out = copy.deepcopy(saved)
    for (path, key), (value, _) in ADDED.items():
        section = _section(out, path)
        if section is not None and key not in section:
            section[key] = value
    return out


def absent_and_idle(saved: Any, ours: dict[str, Any]) -> list[str]:
    """The dotted names of later-added keys that ``saved`` lacks and that do not act on the model of
    ``ours`` (a full config dump): a resume compares them as equal."""
    out = []
    for (path, key), (_, matters) in ADDED.items():
        section, current = _section(saved, path), _section(ours, path)
        if section is not None and current is not None and key not in section and not matters(current):
            out.append(".".join((*path, key)))
    return out
