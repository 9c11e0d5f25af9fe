"""Typed configuration: one section per component, loaded in one place, in one order.

defaults (the classes of ``sections``) < preset YAML (``configs/presets/<name>.yaml``, optionally
``base:``-chained) < dotted command-line overrides (``model.position.kind=rope``). Loading and merging
use OmegaConf, whose interpolations are resolved last (``${oc.env:NAME,default}`` reads an environment
variable); typing and validation use pydantic (unknown keys, wrong types and impossible combinations
are errors that name the key and the fix). Every field carries a one-line docstring, which is its
documentation.

``sections``: the classes; ``types``: the strict value types of their keys (no boolean taken as a
number, finite numbers, seeds in numpy's range, ascending buckets) and what each takes, in words;
``loading``: presets, overrides, validation; ``reference``: the table of every key in docs/config.md
(``python -m tpe_train.config``). Everything is importable from here.
"""

from tpe_train.config import plugins  # the user's own encodings, read at the first lookup
from tpe_train.config.loading import (
    PRESET_DIR,
    format_errors,
    load_config,
    parse_overrides,
    preset_path,
    validate,
)
from tpe_train.config.reference import describe, markdown_reference
from tpe_train.config.sections import (
    RESUME_MODES,
    CleanConfig,
    Config,
    ConfigError,
    DataConfig,
    EvalConfig,
    ModelConfig,
    ParallelConfig,
    PositionConfig,
    Section,
    SyntheticConfig,
    TrainConfig,
)

__all__ = [
    "PRESET_DIR",
    "RESUME_MODES",
    "CleanConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "ModelConfig",
    "ParallelConfig",
    "PositionConfig",
    "Section",
    "SyntheticConfig",
    "TrainConfig",
    "describe",
    "format_errors",
    "load_config",
    "markdown_reference",
    "parse_overrides",
    "plugins",
    "preset_path",
    "validate",
]
