"""The one error of reading or writing a checkpoint or an export."""

from __future__ import annotations

from tpe_train.run.members import MemberError


class CheckpointError(MemberError):
    """A checkpoint or an export cannot be written or used; the message names the file and the fix."""
