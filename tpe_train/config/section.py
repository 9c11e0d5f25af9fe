"""The base of every config section and the config error (imported by the section modules)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration problem, with a message that names the key and the fix."""


class Section(BaseModel):
    """Base of every config section: unknown keys are errors; field docstrings are documentation."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)
