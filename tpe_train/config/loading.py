"""Loading a config: defaults < preset YAML (``base:``-chained) < dotted overrides, resolved by OmegaConf,
validated by pydantic, errors reported as one paragraph per key."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from tpe_train.config.sections import Config, ConfigError
from tpe_train.config.types import allowed

log = logging.getLogger(__name__)
PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "presets"


def preset_path(preset: str) -> Path:
    """A preset name (``configs/presets/<name>.yaml``) or a path to a YAML file."""
    path = Path(preset)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    candidate = PRESET_DIR / f"{preset}.yaml"
    if candidate.is_file():
        return candidate
    names = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
    raise ConfigError(
        f"preset {preset!r} not found: it is neither a YAML file nor one of the presets in "
        f"{PRESET_DIR} ({', '.join(names)}); pass --preset with one of those names or a path"
    )


def _read_preset(preset: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """The preset's mapping, merged over its ``base:`` chain."""
    path = preset_path(preset)
    if str(path) in seen:
        raise ConfigError(f"preset {path} inherits from itself through 'base:'; break the cycle")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (yaml.YAMLError, ValueError) as err:  # ValueError: a number of more than 4300 digits
        raise ConfigError(f"preset {path} is not valid YAML ({err}); fix the file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"preset {path} must be a YAML mapping of sections, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data
    return _merge(_read_preset(str(base), (*seen, str(path))), data)


def _merge(low: dict[str, Any], high: dict[str, Any]) -> dict[str, Any]:
    try:
        merged = OmegaConf.merge(OmegaConf.create(low), OmegaConf.create(high))
    except (OmegaConfBaseException, TypeError, ValueError):  # a mapping over a list, or the reverse
        key, was, given = _clash(low, high) or ("?", "another kind of value", "this one")
        raise ConfigError(
            f"the override of {key} gives {given} where the preset has {was}; give {was} (e.g. a list "
            "as [10,20], a section as its dotted keys: model.position.kind=rope)"
        ) from None
    out = OmegaConf.to_container(merged)
    assert isinstance(out, dict)
    return out  # type: ignore[return-value]


def _kind(value: Any) -> str:
    return (
        "a mapping" if isinstance(value, dict) else "a list" if isinstance(value, list) else "a single value"
    )


def _clash(low: Any, high: Any, prefix: str = "") -> tuple[str, str, str] | None:
    """The first dotted key where ``high`` puts a mapping, a list or a single value over another kind
    in ``low``: (key, low's kind, high's kind)."""
    if not (isinstance(low, dict) and isinstance(high, dict)):
        return None
    for key, value in high.items():
        name = f"{prefix}{key}"
        was = low.get(key)
        containers = isinstance(was, dict | list) or isinstance(value, dict | list)
        if was is not None and value is not None and containers and _kind(was) != _kind(value):
            return name, _kind(was), _kind(value)
        found = _clash(low.get(key), value, f"{name}.")
        if found:
            return found
    return None


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` -> nested dict, values parsed as YAML scalars/lists."""
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key or key.startswith("-"):
            raise ConfigError(
                f"cannot read the override {item!r}: overrides are KEY=VALUE with a dotted key, "
                "e.g. model.position.kind=rope train.max_steps=200"
            )
    try:
        out = OmegaConf.to_container(OmegaConf.from_dotlist(overrides))
    except (OmegaConfBaseException, yaml.YAMLError, ValueError) as err:  # ValueError: a 5000-digit number
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(
            f"cannot read the overrides {overrides} ({first}); write each as KEY=VALUE with a YAML "
            "value, quoting text that holds special characters"
        ) from None
    assert isinstance(out, dict)
    return out  # type: ignore[return-value]


def load_config(preset: str | None = "demo", overrides: list[str] | None = None) -> Config:
    """defaults < preset < overrides, validated. Raises ``ConfigError`` with a readable message."""
    data: dict[str, Any] = {}
    if preset:
        data = _read_preset(preset)
        data.setdefault("preset", Path(preset).stem)
    if overrides:
        data = _merge(data, parse_overrides(overrides))
    cfg = validate(_resolve(data))
    if preset and Path(preset).stem == "demo" and cfg.data.corpus != "synthetic":
        log.warning(
            "data.corpus=%s on the demo preset trains the demo's model on it (d_model %d, a %d-word "
            "vocabulary, %d steps), sized for the embedded corpus; for a corpus of your own use "
            "--preset own_corpus (the base Transformer, the paper's schedule; docs/data.md)",
            cfg.data.corpus,
            cfg.model.d_model,
            cfg.data.vocab_size,
            cfg.train.max_steps,
        )
    return cfg


def _resolve(data: dict[str, Any]) -> dict[str, Any]:
    """OmegaConf interpolations resolved, e.g. ``path: ${oc.env:MULTI30K,../shared/data/multi30k}``
    (an environment variable, with a default after the comma) or ``${model.d_model}``."""
    try:
        out = OmegaConf.to_container(OmegaConf.create(data), resolve=True)
    except OmegaConfBaseException as err:
        raise ConfigError(
            f"cannot resolve an interpolation in the preset or overrides ({str(err).splitlines()[0]}); "
            "set the environment variable, or give a default: ${oc.env:NAME,default}"
        ) from None
    assert isinstance(out, dict)
    return out  # type: ignore[return-value]


def validate(data: dict[str, Any]) -> Config:
    """Build a ``Config`` from a mapping, turning pydantic's errors into one readable paragraph."""
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_errors(err)) from None


def format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = _config_loc(e["loc"])
        key = ".".join(str(p) for p in loc)
        if e["type"] == "extra_forbidden":
            parent = ".".join(str(p) for p in loc[:-1])
            valid = _section_fields(loc[:-1])
            where = f"in section '{parent}'" if parent else "at the top level"
            lines.append(
                f"unknown key '{key}' {where}; valid keys are: {', '.join(valid)} "
                "(check the spelling in the preset or the override)"
            )
        elif e["type"] == "value_error":
            # our validators' messages already name their dotted keys
            lines.append(str(e.get("ctx", {}).get("error", e["msg"])))
        else:
            field = _field(loc)
            takes = f"; {_field_key(loc)} takes {allowed(field)}" if field is not None else ""
            got = _shown(e.get("input"))
            lines.append(f"{key}: {e['msg']} (got {got}){takes}; fix the value in the preset or override")
    return "invalid configuration: " + "; ".join(lines)


def _config_loc(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """The dotted path of an error without pydantic's names of union members (``int``, ``none``, ...)."""
    return tuple(p for p in loc if isinstance(p, int) or p.isidentifier())


def _shown(value: Any) -> str:
    """A short ``repr`` of a bad value (a huge number or a long text is not printed whole)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"a number of about {int(value.bit_length() * 0.30103)} digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + f"... ({len(text)} characters)"


def _field(loc: tuple[int | str, ...]) -> FieldInfo | None:
    """The field an error's location names (a list item's: the list's), if it is one."""
    cls: type[BaseModel] = Config
    found = None
    for part in loc:
        if not isinstance(part, str) or part not in cls.model_fields:
            break
        found = cls.model_fields[part]
        ann = found.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            cls = ann
    return found


def _field_key(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(p) for p in loc if isinstance(p, str))


def _section_fields(loc: tuple[int | str, ...]) -> list[str]:
    cls: type[BaseModel] = Config
    for part in loc:
        field = cls.model_fields.get(str(part))
        ann = field.annotation if field is not None else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        cls = ann
    return list(cls.model_fields)
