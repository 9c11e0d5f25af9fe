"""``python -m tpe_train.config > docs/config.md``: the reference of every config key."""

from __future__ import annotations

from tpe_train.config.reference import markdown_reference


def main() -> int:
    """Print docs/config.md's table of every key, its type, default and documentation."""
    print(markdown_reference(), end="")
    return 0
