"""Training-time position augmentation: each training sequence sees its positions moved at random, so
that the model cannot rely on absolute position values; evaluation and decoding keep 0, 1, 2, ...,
except under ``randomized`` with ``randomized_test`` (below).

- ``shape`` (Kiyono et al. 2021, SHAPE): one integer offset k ~ U{0, ..., K} per sequence, added to
  all its positions: p_i = i + k.
- ``cape`` (Likhomanenko et al. 2021, CAPE): continuous positions p_i = (i + delta + eps_i) * lambda,
  with a global shift delta ~ U[-S, S] and a scale log(lambda) ~ U[-log s, log s] per sequence and a
  jitter eps_i ~ U[-e, e] per position (e <= 1/2 keeps the order).
- ``randomized`` (Ruoss et al. 2023): the L positions of a sequence are L distinct integers drawn
  uniformly from {0, ..., R-1} and sorted. With ``randomized_test`` (the reference's behaviour: its
  model draws whenever it runs), self-attention's positions at test time are drawn too, one sorted
  draw per batch and stack shared by its sentences as in the reference (``eval_draw``); in decoding
  the decoder's length is not known in advance, so its positions are drawn for the source's length
  and continue above the last draw (``decode_draw``). Cross-attention keeps 0, 1, 2, ... as in
  training.

An encoding that supports augmentation lists the methods in ``augments`` and calls
``augment_positions`` from its hook when ``self.training``; the draws come from torch's default
generator of the positions' device (seeded per rank and saved in checkpoints with the rest of the RNG
state), one independent draw per stack (encoder and decoder) and sequence.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: the methods, in the order the config lists them
AUGMENTS = ("none", "shape", "cape", "randomized")


def check_augment(kind: str, augments: tuple[str, ...], augment: str) -> None:
    """Refuse ``augment`` for an encoding ``kind`` that does not support it (``augments``: those it does)."""
    if augment not in AUGMENTS:
        raise ValueError(
            f"model.position.augment={augment!r} is not a position augmentation; choose one of: "
            f"{', '.join(AUGMENTS)}"
        )
    if augment == "none" or augment in augments:
        return
    if augments:
        fix = f"choose model.position.augment from: none, {', '.join(augments)}"
    else:
        fix = "augmentation moves absolute positions, which it has none of; set model.position.augment=none"
    why = " (a learned table has rows for integer positions only)" if augment == "cape" and augments else ""
    raise ValueError(
        f"model.position.augment={augment} does not apply to model.position.kind={kind}{why}; {fix}, "
        "or choose an encoding it applies to (sinusoidal, learned, rope)"
    )


def augment_positions(
    pos: Tensor,
    batch: int,
    augment: str,
    *,
    max_shift: int = 0,
    cape_shift: float = 0.0,
    cape_jitter: float = 0.0,
    cape_scale: float = 1.0,
    randomized_range: int = 0,
) -> Tensor:
    """The (L,) positions ``pos`` of a batch of ``batch`` sequences as (batch, L) augmented positions:
    ``long`` for shape and randomized, ``float64`` for cape (``pos`` itself, (L,), for none)."""
    if augment == "none":
        return pos
    length = pos.shape[0]
    device = pos.device
    if augment == "shape":
        shift = torch.randint(0, max_shift + 1, (batch, 1), device=device)
        return pos[None, :] + shift
    if augment == "cape":
        f64 = torch.float64
        delta = (torch.rand(batch, 1, dtype=f64, device=device) * 2 - 1) * cape_shift
        eps = (torch.rand(batch, length, dtype=f64, device=device) * 2 - 1) * cape_jitter
        log_scale = (torch.rand(batch, 1, dtype=f64, device=device) * 2 - 1) * math.log(cape_scale)
        return (pos.to(f64)[None, :] + delta + eps) * log_scale.exp()
    if augment == "randomized":
        if length > randomized_range:
            raise ValueError(
                f"a sequence of {length} positions cannot take distinct positions from "
                f"model.position.randomized_range={randomized_range}; raise randomized_range"
            )
        draws = torch.rand(batch, randomized_range, device=device).argsort(dim=1)[:, :length]
        return draws.sort(dim=1).values
    raise ValueError(f"unknown position augmentation {augment!r}; choose one of: {', '.join(AUGMENTS)}")


#: the seed of the test-time draws' generator, restarted whenever an encoding enters evaluation mode
#: (``PositionEncoding.train``), so an evaluation draws the same positions whatever ran before it and
#: never moves the training generator (plus ``causal``: the decoder's draws differ from the encoder's)
TEST_SEED = 20230526


def eval_draw(length: int, randomized_range: int, generator: torch.Generator) -> Tensor:
    """``randomized`` at test time: ``length`` sorted distinct positions drawn uniformly from
    {0, ..., R-1} by ``generator`` (a CPU one), one (length,) draw shared by a batch (the reference
    draws one per call)."""
    if length > randomized_range:
        raise ValueError(
            f"a sequence of {length} positions cannot take distinct positions from "
            f"model.position.randomized_range={randomized_range} at test time; shorten the input, raise "
            "randomized_range (retraining) or set model.position.randomized_test=false"
        )
    return torch.randperm(randomized_range, generator=generator)[:length].sort().values


def decode_draw(expected: int, limit: int, randomized_range: int, generator: torch.Generator) -> Tensor:
    """``randomized`` in decoding: the decoder's positions (limit,) for up to ``limit`` steps, drawn
    before the first step. Training draws a target's positions for its length; the decoder's output
    length is not known in advance, so the first ``expected`` (the source's length, at most
    ``limit``) are a sorted draw of that many as in training, and later steps take a sorted draw of
    the positions left above the last one; once those run out, every later step takes R-1."""
    first = min(expected, limit)
    drawn = eval_draw(first, randomized_range, generator)
    top = int(drawn[-1]) if first else -1
    left = randomized_range - 1 - top
    more = min(limit - first, left)
    above = top + 1 + torch.randperm(left, generator=generator)[:more].sort().values
    rest = torch.full((limit - first - more,), randomized_range - 1, dtype=drawn.dtype)
    return torch.cat((drawn, above, rest))


def drawn_positions_refusal(augment: str, randomized_test: bool, target: str) -> str | None:
    """Why a model cannot run as trained in ``target`` (an exporter's runtime, which feeds positions
    0, 1, 2, ...): it draws its positions at test time; None where it does not."""
    if augment != "randomized" or not randomized_test:
        return None
    return (
        f"this model draws its self-attention positions whenever it runs (model.position.augment=randomized "
        f"with randomized_test=true, as trained), and {target} feeds positions 0, 1, 2, ..., which it never "
        "saw in training; export --format native (tpe-eval and tpe-translate draw them)"
    )
