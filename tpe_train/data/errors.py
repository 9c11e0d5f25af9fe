"""The data layer's one error type."""

from __future__ import annotations


class CorpusError(ValueError):
    """Bad corpus input, with a message naming the file (or split, or language) and the fix."""
