"""When the loop logs, validates and saves: the questions it asks each step, answered in one place.

Every periodic action also happens at the last step, so a run always ends logged, validated and saved.
A checkpoint is also written at once when the run must stop (a preemption signal, early stopping) and
when a validation is the best so far under ``eval.select=best`` (the checkpoint selection picks later).
"""

from __future__ import annotations

from dataclasses import dataclass

from tpe_train.config import TrainConfig


@dataclass(frozen=True)
class Cadence:
    """The ``train`` section's intervals (``save_every`` 0: only at the end and when asked;
    ``diagnostics_every`` 0: never)."""

    max_steps: int
    log_every: int
    valid_every: int
    save_every: int
    diagnostics_every: int = 0  # 0: never

    @classmethod
    def of(cls, cfg: TrainConfig) -> Cadence:
        return cls(cfg.max_steps, cfg.log_every, cfg.valid_every, cfg.save_every, cfg.diagnostics_every)

    def last(self, step: int) -> bool:
        return step == self.max_steps

    def should_log(self, step: int) -> bool:
        return step % self.log_every == 0 or self.last(step)

    def should_validate(self, step: int) -> bool:
        return step % self.valid_every == 0 or self.last(step)

    def should_diagnose(self, step: int) -> bool:
        """Position diagnostics (``train.diagnostics_every``; 0: never, not even at the end)."""
        return self.diagnostics_every > 0 and (step % self.diagnostics_every == 0 or self.last(step))

    def should_draw_tables(self, step: int) -> bool:
        """The learned tables' similarity images: at the diagnostics steps that are also validation
        steps, and the last. At every diagnostics step they were most of a run's TensorBoard events
        (two 256 x 256 images per 100 steps: 11.8 MB in 5,000 steps)."""
        return self.should_diagnose(step) and self.should_validate(step)

    def should_save(self, step: int, *, stopping: bool = False, new_best: bool = False) -> bool:
        """``stopping``: preempted or stopped early; ``new_best``: the best validation to keep."""
        periodic = self.save_every > 0 and step % self.save_every == 0
        return stopping or new_best or periodic or self.last(step)
