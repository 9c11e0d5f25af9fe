"""The one error of reading or writing a checkpoint or an export."""

from __future__ import annotations

from tpe_train.run.members import MemberError


class CheckpointError(MemberError):
    """A checkpoint or an export cannot be written or used; the message names the file and the fix."""


class UnknownFormat(CheckpointError):
    """A manifest of a format this version does not read (a newer tpe-train's): not a damaged checkpoint,
    so ``prune`` leaves it alone."""

    def __init__(self, found: object, message: str) -> None:
        super().__init__(message)
        self.found = found
