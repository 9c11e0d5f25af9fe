"""Position diagnostics of a model on one batch: what its attention and its position vectors do.

- Mean attention distance, per layer and head of encoder and of (causal) decoder self-attention: for
  each real (non-pad) query position i, sum_j p_ij |i - j| over the keys j, averaged over the real
  queries of the batch. ``p`` is the model's own attention: each self-attention layer hands its
  probabilities to a probe (``Attention.probe``; the call then takes the explicit backend), after the
  encoding's rotation (RoPE), its logit term (T5, ALiBi, Shaw's relative keys), the scaling, padding
  and causality, exactly as that backend computes them. Nothing is recomputed beside the model.
- Position similarity: the cosine similarity of every pair of the position vectors an encoding adds to
  the token embeddings (its ``embed`` hook: a learned table's rows, sinusoids), as a (P, P) matrix.

Without a probe set, attention runs as before: the probe is off outside these functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from tpe_train.model.attention import Attention
from tpe_train.model.transformer import Stack, Transformer
from tpe_train.positions import PositionEncoding

#: the two stacks measured, by their names in a Transformer
SIDES = ("encoder", "decoder")


def mean_distance(weights: Tensor, q_pos: Tensor, k_pos: Tensor, real: Tensor) -> Tensor:
    """Per head, sum_j p_ij |q_pos_i - k_pos_j| averaged over the real queries (float64).

    weights: (B, H, Lq, Lk) attention probabilities; q_pos (Lq,), k_pos (Lk,) positions; real: (B, Lq)
    bool, False at padded query rows (left out of the mean). Returns (H,)."""
    distance = (q_pos[:, None] - k_pos[None, :]).abs().to(torch.float64)  # (Lq, Lk)
    per_query = torch.einsum("bhqk,qk->bhq", weights.to(torch.float64), distance)  # (B, H, Lq)
    keep = real[:, None, :].to(torch.float64)
    return (per_query * keep).sum((0, 2)) / keep.sum().clamp(min=1.0)


@dataclass
class Distances:
    """Mean attention distances, (layers, heads) per side, for the heads ``heads`` (global indices:
    under tensor parallelism a rank holds a block of them)."""

    encoder: Tensor
    decoder: Tensor
    heads: list[int]

    def side(self, name: str) -> Tensor:
        return self.encoder if name == "encoder" else self.decoder


def _self_attention(stack: Stack) -> list[Attention]:
    out = []
    for layer in stack.layers:
        attn = getattr(layer, "self_attn")  # noqa: B009 - every Layer has one
        assert isinstance(attn, Attention)
        out.append(attn)
    return out


@contextlib.contextmanager
def probed(model: Transformer, real: dict[str, Tensor]) -> Iterator[dict[str, list[Tensor]]]:
    """Within it, every self-attention layer of the two stacks adds its per-head mean distance (see
    ``mean_distance``, queries ``real[side]``) to the lists yielded, one entry per call and layer;
    the probes are removed on the way out, whatever happens."""
    found: dict[str, list[Tensor]] = {side: [] for side in SIDES}
    layers = {side: _self_attention(getattr(model, side)) for side in SIDES}

    def probe_of(side: str) -> object:
        def probe(weights: Tensor, q_pos: Tensor, k_pos: Tensor) -> None:
            found[side].append(mean_distance(weights.detach(), q_pos, k_pos, real[side]))

        return probe

    try:
        for side in SIDES:
            for attn in layers[side]:
                attn.probe = probe_of(side)  # type: ignore[assignment]
        yield found
    finally:
        for side in SIDES:
            for attn in layers[side]:
                attn.probe = None


@torch.no_grad()
def attention_distances(
    model: Transformer, src: Tensor, tgt_in: Tensor, heads: list[int] | None = None
) -> Distances:
    """Mean attention distances of encoder and decoder self-attention on one teacher-forced batch
    (src: (B, Ls) ids, tgt_in: (B, Lt) BOS-prefixed ids, right-padded), in evaluation mode (no dropout;
    the training mode is restored after). Draws no random numbers. ``heads``: the global index of each
    head the layers compute (tensor parallelism: the rank's block); None: all of them, 0 .. H-1."""
    pad = model.args.pad_id
    real = {"encoder": src != pad, "decoder": tgt_in != pad}
    training = model.training
    model.eval()
    try:
        with probed(model, real) as found:
            model(src, tgt_in)
    finally:
        model.train(training)
    per_side = {side: torch.stack(found[side]).cpu() for side in SIDES}  # (layers, heads)
    count = per_side["encoder"].shape[1]
    heads = list(range(count)) if heads is None else list(heads)
    if len(heads) != count:
        raise ValueError(f"{len(heads)} head indices given for attention layers of {count} heads")
    return Distances(per_side["encoder"], per_side["decoder"], heads)


def position_vectors(pos: PositionEncoding, length: int, device: torch.device) -> Tensor | None:
    """The vectors ``pos.embed`` adds at positions 0 .. length-1, (length, d) float64 on the CPU, or
    None when it adds nothing (none, RoPE, T5, ALiBi, Shaw)."""
    d = pos.args.d_model
    positions = torch.arange(length, device=device)
    with torch.no_grad():
        rows = pos.embed(torch.zeros(1, length, d, device=device), positions)[0]
    rows = rows.detach().to(torch.float64).cpu()
    return rows if bool(rows.ne(0).any()) else None


def cosine_similarity(rows: Tensor) -> Tensor:
    """(P, P) cosine similarities of the rows of ``rows`` (P, d); a zero row is similar to nothing."""
    unit = rows / rows.norm(dim=1, keepdim=True).clamp(min=1e-12)
    return unit @ unit.T


def position_similarity(model: Transformer, length: int, learned_only: bool = False) -> dict[str, Tensor]:
    """Per side whose encoding adds position vectors, the (P, P) cosine similarity of those vectors
    at positions 0 .. P-1: P = the encoding's limit (a learned table's rows, as extended at test time)
    or ``length`` where it has none. ``learned_only``: only encodings with parameters (a table that
    changes during training). Every tensor-parallel rank must call it (a split table's lookup is a
    collective)."""
    out: dict[str, Tensor] = {}
    device = next(model.parameters()).device
    for side in SIDES:
        pos = getattr(model, side).pos(0)
        if learned_only and not any(True for _ in pos.parameters()):
            continue
        rows = position_vectors(pos, pos.max_length or length, device)
        if rows is not None:
            out[side] = cosine_similarity(rows)
    return out
