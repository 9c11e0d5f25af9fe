"""The value types of config keys, strict where YAML and pydantic are lax, and their descriptions.

pydantic takes ``true`` for the integer 1 and the float 1.0 (a bool is an int in Python), and any
float, ``nan`` and ``inf`` included. Config keys use these types instead: ``Int`` (a whole number in
int64, never a boolean), ``Float`` (a finite number, never a boolean), ``Bool`` (``true`` or
``false`` only), ``Text`` (one line without control characters), ``Seed`` (numpy's range),
``Buckets`` (positive and ascending) and ``Beta`` (in [0, 1)). ``allowed`` describes what a field
takes, for docs/config.md and for the error of a value outside it.
"""

from __future__ import annotations

import itertools
from typing import Annotated, Any, Literal, get_args, get_origin

import annotated_types as at
from pydantic import AfterValidator, BeforeValidator, Field, Strict
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

INT_MAX = 2**63 - 1  # what a torch or numpy int64 holds
SEED_MAX = 2**32 - 1  # numpy's np.random.seed takes [0, 2**32 - 1]


def _number(value: Any) -> Any:
    """Turn away booleans (an int subclass) and integers too large to print before pydantic sees them."""
    if isinstance(value, bool):
        raise PydanticCustomError("bool_not_number", "a number is needed, not a boolean")
    if isinstance(value, int) and value.bit_length() > 256:
        raise PydanticCustomError("number_too_large", "the number is far too large")
    if isinstance(value, str) and len(value) > 100:
        raise PydanticCustomError("number_too_long", "a number is needed, not a long text")
    return value


def _one_line(value: str) -> str:
    """Refuse control characters (a newline, NUL, ...) in a name, a path or a mode."""
    bad = next((ch for ch in value if ord(ch) < 32 or ord(ch) == 127), None)
    if bad is not None:
        raise PydanticCustomError("control_character", "the text holds the control character {char}",
                                  {"char": repr(bad)})  # fmt: skip
    return value


def _ascending(values: list[int]) -> list[int]:
    if any(b <= a for a, b in itertools.pairwise(values)):
        raise PydanticCustomError("not_ascending", "the list must be strictly ascending (sorted, no repeats)")
    return values


Int = Annotated[int, BeforeValidator(_number), Field(ge=-INT_MAX - 1, le=INT_MAX)]
"""A whole number that an int64 holds; ``true``/``false`` and fractions are errors."""
Float = Annotated[float, BeforeValidator(_number), Field(allow_inf_nan=False)]
"""A finite number; ``true``/``false``, ``nan`` and ``inf`` are errors."""
Bool = Annotated[bool, Strict()]
"""``true`` or ``false``; numbers and strings are errors."""
Text = Annotated[str, Strict(), AfterValidator(_one_line)]
"""One line of text without control characters."""
Seed = Annotated[int, BeforeValidator(_number), Field(ge=0, le=SEED_MAX)]
"""A random seed in numpy's range [0, 2**32 - 1]."""
Beta = Annotated[float, BeforeValidator(_number), Field(ge=0.0, lt=1.0, allow_inf_nan=False)]
"""A moving-average coefficient of Adam, in [0, 1)."""
Buckets = Annotated[
    list[Annotated[int, BeforeValidator(_number), Field(ge=1, le=INT_MAX)]], AfterValidator(_ascending)
]
"""Positive whole numbers, strictly ascending."""


def bounds(metadata: list[Any]) -> str:
    """``>= 1``, ``in [0, 1)``, ``> 0``: the bounds of a field's metadata, the int64 ones left out."""
    low = high = ""
    for m in metadata:
        if isinstance(m, at.Ge) and m.ge != -INT_MAX - 1:
            low = f"[{m.ge}"
        elif isinstance(m, at.Gt):
            low = f"({m.gt}"
        elif isinstance(m, at.Le) and m.le != INT_MAX:
            high = f"{m.le}]"
        elif isinstance(m, at.Lt):
            high = f"{m.lt})"
    if low and high:
        return f" in {low}, {high}"
    if low:
        return f" {'>=' if low[0] == '[' else '>'} {low[1:]}"
    if high:
        return f" {'<=' if high[-1] == ']' else '<'} {high[:-1]}"
    return ""


def _kind(annotation: Any, metadata: list[Any]) -> str:
    origin = get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in get_args(annotation))
    if origin is tuple:
        parts = [_annotated(p) for p in get_args(annotation)]
        if len(set(parts)) == 1:
            return f"a list of {len(parts)}, each " + parts[0]
        return f"a list of {len(parts)}: " + "; ".join(parts)
    if origin is list:
        return "ascending whole numbers" + _annotated(get_args(annotation)[0]).removeprefix("a whole number")
    args = [a for a in get_args(annotation) if a is not type(None)]
    if args and len(args) < len(get_args(annotation)):  # X | None
        return _annotated(args[0], metadata) + ", or empty"
    names = {bool: "true or false", int: "a whole number", float: "a finite number", str: "text (one line)"}
    return names.get(annotation, str(annotation)) + bounds(metadata)


def _annotated(annotation: Any, outer: list[Any] | None = None) -> str:
    """``Annotated[int, ...]``: what it takes (``outer``: the field's own bounds, which come last)."""
    if get_origin(annotation) is Annotated:
        base, *extra = get_args(annotation)
        metadata = [m for e in extra for m in (e.metadata if isinstance(e, FieldInfo) else [e])]
        return _kind(base, metadata + (outer or []))
    return _kind(annotation, outer or [])


def allowed(field: FieldInfo) -> str:
    """What a field takes, in words: ``a whole number >= 1``, ``one of auto, sdpa``, ... (or its own
    words, ``json_schema_extra={"takes": ...}``, where a validator narrows the type)."""
    extra = field.json_schema_extra
    if isinstance(extra, dict) and isinstance(extra.get("takes"), str):
        return str(extra["takes"])
    return _kind(field.annotation, field.metadata)
