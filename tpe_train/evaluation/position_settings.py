"""Test-time position settings (``--position KEY=VALUE`` of tpe-eval and tpe-translate): change a
trained model's position encodings for longer inputs without retraining (see docs/evaluation.md).

Keys are ``ENCODING.SETTING`` (``rope.scaling=yarn``, ``rope.factor=2``, ``alibi.slope_scale=0.5``,
``t5.max_distance=256``, ``learned.extend=interpolate``, ``learned.factor=2``) and ``side`` (``encoder``,
``decoder`` (self-attention), ``cross`` or ``both``, the default: every side). Each encoding's
``adapt`` reads its settings; the state dict is untouched.
"""

from __future__ import annotations

from tpe_train.model.transformer import Transformer
from tpe_train.positions import POSITIONS, PositionEncoding

SIDES = ("encoder", "decoder", "cross")


def parse_position_settings(items: list[str]) -> tuple[list[str], dict[str, dict[str, str]]]:
    """``KEY=VALUE`` items -> (sides, {encoding: {setting: value}}); ValueError names a bad item."""
    sides = list(SIDES)
    settings: dict[str, dict[str, str]] = {}
    for item in items:
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ValueError(f"--position {item!r}: give KEY=VALUE, e.g. --position rope.scaling=yarn")
        if key == "side":
            if value not in (*SIDES, "both"):
                raise ValueError(f"--position side={value}: choose encoder, decoder, cross or both")
            sides = list(SIDES) if value == "both" else [value]
            continue
        kind, dot, name = key.partition(".")
        if not dot or kind not in POSITIONS or not name:
            raise ValueError(
                f"--position {item!r}: give ENCODING.SETTING=VALUE with ENCODING one of "
                f"{', '.join(POSITIONS.names())}, or side=encoder|decoder|cross|both"
            )
        settings.setdefault(kind, {})[name] = value
    return sides, settings


def _kind(enc: PositionEncoding) -> str:
    return next(name for name in POSITIONS.names() if type(enc) is POSITIONS.get(name))


def side_encodings(model: Transformer, side: str) -> list[PositionEncoding]:
    """The position modules of one side: encoder, decoder (self-attention) or cross."""
    if side == "encoder":
        modules = list(model.encoder.positions)
    elif side == "decoder":
        modules = list(model.decoder.positions)
    else:
        modules = list(model.decoder.cross_positions or [])
    return [m for m in modules if isinstance(m, PositionEncoding)]


def apply_position_settings(model: Transformer, items: list[str], original: int | None = None) -> list[str]:
    """Apply ``--position`` items to a loaded model; returns one line per side changed.

    ``original``: the trained context length, YaRN's ``rope.original`` (``xpos.original``) unless
    given (the commands pass the config's data.max_len + 1). Settings of an encoding the chosen sides
    do not use are an error.
    """
    sides, settings = parse_position_settings(items)
    for rotary in ("rope", "xpos"):
        if rotary in settings and settings[rotary].get("scaling") == "yarn" and original is not None:
            settings[rotary].setdefault("original", str(original))
    found = {side: side_encodings(model, side) for side in sides}
    done = []
    for kind, values in settings.items():
        hits = [(side, enc) for side, encs in found.items() for enc in encs if _kind(enc) == kind]
        if not hits:
            used = ", ".join(f"{side}: {_kind(encs[0])}" for side, encs in found.items() if encs)
            raise ValueError(f"--position {kind}.*: no {kind} encoding on the chosen sides ({used})")
        for _, enc in hits:
            enc.adapt(**values)
        changed = sorted({side for side, _ in hits}, key=SIDES.index)
        text = " ".join(f"{kind}.{k}={v}" for k, v in values.items())
        done += [f"{side}: {text}" for side in changed]
    return done
