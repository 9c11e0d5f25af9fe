"""Where the training figures go: TensorBoard scalars, and one line of them for a log."""

from __future__ import annotations

from torch.utils.tensorboard import SummaryWriter

_LINE_FIGURES = (  # (scalar, label, format) of a log line, in this order
    ("train/loss", "loss", "{:.3f}"),
    ("train/nll", "nll", "{:.3f}"),
    ("train/lr", "lr", "{:.2e}"),
    ("train/grad_norm", "gnorm", "{:.2f}"),  # inf or nan at an fp16 overflow (the step was skipped)
    ("train/loss_scale", "scale", "{:.0f}"),  # fp16 only
    ("train/tokens_per_s", "tok/s", "{:,.0f}"),
    ("train/mfu", "mfu", "{:.1%}"),
    ("valid/nll", "valid nll", "{:.3f}"),
    ("valid/ppl", "valid ppl", "{:.2f}"),
    ("valid/bleu", "valid bleu", "{:.2f}"),
)


def log_line(step: int, max_steps: int, scalars: dict[str, float]) -> str:
    """One line of training or validation figures, e.g. ``step 100/9000 | loss 7.334 | ...``;
    the figures a scalar dict lacks are left out."""
    cells = [f"{label} {fmt.format(scalars[key])}" for key, label, fmt in _LINE_FIGURES if key in scalars]
    return " | ".join([f"step {step}/{max_steps}", *cells])


def write_scalars(writer: SummaryWriter | None, scalars: dict[str, float], step: int) -> None:
    """The scalars at ``step`` to TensorBoard (rank 0 has a writer, the others None)."""
    if writer is not None:
        for name, value in scalars.items():
            writer.add_scalar(name, value, step)
