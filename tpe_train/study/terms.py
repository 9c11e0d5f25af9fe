"""What ``tpe-study``'s command line needs before torch loads: the default settings and the error of bad
input (``grid`` holds the rest of the study's plan)."""

from __future__ import annotations

ENCODINGS = ("none", "sinusoidal", "learned", "shaw", "t5", "rope", "alibi")


class StudyError(ValueError):
    """Bad input to the study, with a message that says what to change."""
