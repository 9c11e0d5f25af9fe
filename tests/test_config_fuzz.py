"""Random values for every config key (hypothesis): a load either gives a value that the key takes, or
stops with the project's ``ConfigError``; no other exception, and nothing outside the key's range.

Two routes: Python values set into the demo preset's mapping and validated (what a preset's YAML
gives), and override text (``key=TEXT``, what the command line gives). The examples are derandomised,
so a run is repeatable; the counts are in ``EXAMPLES``.
"""

from __future__ import annotations

import itertools
import math
import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import annotated_types as at
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from tpe_train.config import Config, ConfigError, load_config, validate

EXAMPLES = {"values": 200, "overrides": 400, "presets": 150, "combinations": 300}
INT64 = (-(2**63), 2**63 - 1)


def _fields(cls: type[BaseModel] = Config, prefix: str = "") -> dict[str, FieldInfo]:
    out: dict[str, FieldInfo] = {}
    for name, field in cls.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.update(_fields(ann, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = field
    return out


FIELDS = _fields()
KEYS = sorted(FIELDS)
BASE = load_config("demo").model_dump(mode="json")

# What the issue names, stated here on its own (not read from the classes under test).
SEEDS = ("train.seed", "data.synthetic.seed")
ODD = [
    True,
    False,
    None,
    -1,
    0,
    1,
    2**31,
    2**32 - 1,
    2**32,
    2**63 - 1,
    2**63,
    -(2**63) - 1,
    10**400,
    10**5000,
]
ODD_TEXT = [
    "true",
    "false",
    "null",
    "-1",
    "0",
    "nan",
    "-nan",
    ".nan",
    "inf",
    "-inf",
    ".inf",
    "1e400",
    "1e-400",
    "0x10",
    "1_000",
    "4294967296",
    "9223372036854775808",
    "1" * 5000,
    "[]",
    "[3,1]",
    "[1,1]",
    "[-5,10]",
    "[0.9,1.0]",
    "[0.9]",
    "{}",
    "{a: 1}",
    "''",
    "a b",
    "\t",
    "auto",
    "AUTO",
    "${oc.env:NO_SUCH_VAR}",
    "${train.lr}",
    "[",
    "]",
    "'",
    '"',
    "{",
    ",",
    ":",
    "=",
    "#",
    "~",
]

values = st.one_of(
    st.sampled_from(ODD),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(ODD_TEXT),
    st.lists(st.one_of(st.integers(-3, 60), st.floats(-2, 2)), max_size=5),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
override_text = st.one_of(
    st.sampled_from(ODD_TEXT),
    st.sampled_from(ODD_TEXT),
    st.text(max_size=16),
    st.integers().map(str),
    st.floats().map(repr),
    st.lists(st.integers(-3, 60), max_size=5).map(lambda xs: "[" + ",".join(map(str, xs)) + "]"),
)


def _meta(annotation: Any, metadata: list[Any]) -> tuple[Any, list[Any]]:
    """The bare type of an ``Annotated`` one, with its bounds before ``metadata``."""
    if get_origin(annotation) is Annotated:
        base, *extra = get_args(annotation)
        inner = [m for e in extra for m in (e.metadata if isinstance(e, FieldInfo) else [e])]
        return base, inner + metadata
    return annotation, metadata


def _within(value: Any, metadata: list[Any]) -> bool:
    ok = True
    for m in metadata:
        if isinstance(m, at.Ge):
            ok = ok and value >= m.ge
        elif isinstance(m, at.Gt):
            ok = ok and value > m.gt
        elif isinstance(m, at.Le):
            ok = ok and value <= m.le
        elif isinstance(m, at.Lt):
            ok = ok and value < m.lt
    return ok


def takes(value: Any, annotation: Any, metadata: list[Any]) -> bool:
    """Whether ``value`` is what a field of this type and these bounds may hold."""
    annotation, metadata = _meta(annotation, metadata)
    origin = get_origin(annotation)
    if origin is Literal:
        return value in get_args(annotation) and type(value) is str
    if origin is tuple:
        parts = get_args(annotation)
        return (
            type(value) is tuple
            and len(value) == len(parts)
            and all(takes(v, p, []) for v, p in zip(value, parts, strict=True))
        )
    if origin is list:
        (item,) = get_args(annotation)
        return (
            type(value) is list
            and all(takes(v, item, []) for v in value)
            and all(b > a for a, b in itertools.pairwise(value))
        )
    args = get_args(annotation)
    if type(None) in args:
        return value is None or takes(value, next(a for a in args if a is not type(None)), metadata)
    if annotation is bool:
        return type(value) is bool
    if annotation is int:
        return type(value) is int and INT64[0] <= value <= INT64[1] and _within(value, metadata)
    if annotation is float:
        return type(value) is float and math.isfinite(value) and _within(value, metadata)
    if annotation is str:
        return type(value) is str and not any(ord(c) < 32 or ord(c) == 127 for c in value)
    raise AssertionError(f"no check for {annotation}")


def _get(cfg: Config, key: str) -> Any:
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _set(data: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    out = {**data}
    node = out
    *parents, last = key.split(".")
    for part in parents:
        node[part] = {**node[part]}
        node = node[part]
    node[last] = value
    return out


NON_FINITE = {"nan", "-nan", ".nan", "inf", "-inf", ".inf", "-.inf", "1e400"}


def check(cfg: Config, key: str, given: Any, yaml_text: bool = False) -> None:
    """The loaded value is one the key takes, what was given was not turned into another kind (a
    boolean into a number, NaN into anything; ``yaml_text``: ``given`` is YAML text), and the issue's own
    ranges hold."""
    value = _get(cfg, key)
    field = FIELDS[key]
    text = given.strip().lower() if yaml_text and isinstance(given, str) else None
    if isinstance(given, bool) or text in ("true", "false"):
        assert type(value) is bool, f"{key}: the boolean {given!r} was taken as {value!r}"
    if isinstance(given, float) and not math.isfinite(given):
        raise AssertionError(f"{key}: {given!r} was taken as {value!r}")
    if text in NON_FINITE:
        assert type(value) is str, f"{key}: {given!r} was taken as {value!r}"
    assert takes(value, field.annotation, field.metadata), f"{key} loaded as {value!r}"
    if key in SEEDS:
        assert 0 <= value <= 2**32 - 1
    if key == "eval.length_buckets":
        assert all(v >= 1 for v in value) and value == sorted(set(value))
    if key == "train.adam_betas":
        assert all(0 <= b < 1 for b in value)
    if key.endswith(("lr", "eps", "alpha", "dropout", "smoothing")):
        assert math.isfinite(value) and value >= 0


@settings(max_examples=EXAMPLES["values"], deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(value=values)
def test_any_value_for_any_key_loads_within_range_or_is_a_config_error(value: Any) -> None:
    for key in KEYS:
        try:
            cfg = validate(_set(BASE, key, value))
        except ConfigError as err:
            assert key.split(".")[-1] in str(err) or "invalid configuration" in str(err)
            continue
        check(cfg, key, value)


@settings(max_examples=EXAMPLES["overrides"], deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(key=st.sampled_from(KEYS), text=override_text)
def test_any_override_text_loads_within_range_or_is_a_config_error(key: str, text: str) -> None:
    try:
        cfg = load_config("demo", [f"{key}={text}"])
    except ConfigError:
        return
    check(cfg, key, text, yaml_text=True)


@settings(max_examples=EXAMPLES["presets"], deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(key=st.sampled_from(KEYS), text=override_text)
def test_any_preset_value_loads_within_range_or_is_a_config_error(key: str, text: str) -> None:
    """The same texts as the value of a key in a preset file (``base: demo``)."""
    *sections, last = key.split(".")
    lines = ["base: demo"] + [f"{'  ' * i}{part}:" for i, part in enumerate(sections)]
    lines.append(f"{'  ' * len(sections)}{last}: {text}")
    with tempfile.TemporaryDirectory() as folder:
        preset = Path(folder) / "fuzz.yaml"
        preset.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogatepass")
        try:
            cfg = load_config(str(preset))
        except ConfigError:
            return
    check(cfg, key, text, yaml_text=True)


def _in_range(annotation: Any, metadata: list[Any]) -> st.SearchStrategy[Any]:
    """Values a key takes on its own (small ones), to reach the checks that join keys."""
    annotation, metadata = _meta(annotation, metadata)
    last = list(reversed(metadata))  # the field's own bounds come after its type's
    lows = [m.ge if isinstance(m, at.Ge) else m.gt for m in last if isinstance(m, at.Ge | at.Gt)]
    highs = [m.le if isinstance(m, at.Le) else m.lt for m in last if isinstance(m, at.Le | at.Lt)]
    low: Any = lows[0] if lows else 0
    high: Any = highs[0] if highs else None
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return st.sampled_from(args)
    if origin is tuple:
        return st.tuples(*(_in_range(a, []) for a in args))
    if origin is list:
        return st.lists(st.integers(1, 80), max_size=5, unique=True).map(sorted)
    if type(None) in args:
        return st.none() | _in_range(next(a for a in args if a is not type(None)), metadata)
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        low = max(int(low), -5)
        return st.integers(low, low + 80 if high is None else min(int(high), low + 80))
    if annotation is float:
        top = float(low) + 10 if high is None else float(high)
        return st.floats(float(low), top, exclude_min=True, exclude_max=True)
    return st.sampled_from(["none", "sinusoidal", "learned", "rope", "t5", "alibi", "shaw", "auto", "x", ""])


combinations = st.lists(st.sampled_from(KEYS), min_size=2, max_size=6, unique=True).flatmap(
    lambda keys: st.fixed_dictionaries({k: _in_range(FIELDS[k].annotation, FIELDS[k].metadata) for k in keys})
)


@settings(max_examples=EXAMPLES["combinations"], deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(changes=combinations)
def test_several_keys_at_once_load_within_range_or_are_a_config_error(changes: dict[str, Any]) -> None:
    """Values each key takes on its own, several keys at once: the checks that join keys (heads and
    width, averaging and saving, positions and lengths) give a ConfigError or a config in range."""
    data = BASE
    for key, value in changes.items():
        data = _set(data, key, value)
    try:
        cfg = validate(data)
    except ConfigError:
        return
    for key, value in changes.items():
        check(cfg, key, value)


@pytest.mark.parametrize("key", KEYS)
def test_every_key_refuses_a_value_of_the_wrong_kind(key: str) -> None:
    """Each key refuses at least one of a boolean, NaN, a text and a nested mapping, naming itself."""
    refused = 0
    for value in (True, float("nan"), "not a value\n", {"x": 1}):
        try:
            validate(_set(BASE, key, value))
        except ConfigError as err:
            refused += 1
            assert key in str(err), str(err)
    assert refused >= 2
