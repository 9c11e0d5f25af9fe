"""Position diagnostics on a fixed batch of text pairs: the figures, their JSON, table and images.

What is measured (``tpe_train.model.position_stats``): per layer and head of encoder and decoder
self-attention, the mean attention distance sum_j p_ij |i - j| over real query positions; for an
encoding that adds position vectors to the embeddings, the cosine similarity of those vectors.

The batch is fixed: the first ``DIAGNOSTIC_PAIRS`` pairs of a split whose source and target (each with
EOS) fit ``data.max_len`` tokens, in the split's order, encoded as training encodes them. Training
measures the validation split every ``train.diagnostics_every`` steps (TensorBoard); ``tpe-eval
--diagnostics`` measures the first set it scores (``--split`` with ``data.valid_split``: the batch of
training).

    tpe-eval --checkpoint DIR --split validation --diagnostics --out DIR2   # diagnostics.json, a table
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import Tensor

from tpe_train.data.batching import BOS_ID, EOS_ID, pad
from tpe_train.data.synthetic import Pair
from tpe_train.data.tokenizer import encode
from tpe_train.evaluation.options import DIAGNOSTIC_PAIRS as DIAGNOSTIC_PAIRS
from tpe_train.evaluation.options import JSON_NAME
from tpe_train.model.position_stats import SIDES, Distances, attention_distances, position_similarity
from tpe_train.model.transformer import Transformer

#: the largest side of a similarity image; a longer table is averaged down to it (TensorBoard's size)
IMAGE_SIDE = 256
SHORT = {"encoder": "enc", "decoder": "dec"}


def diagnostic_batch(
    tok: Tokenizer, pairs: list[Pair], max_len: int, limit: int = DIAGNOSTIC_PAIRS
) -> tuple[Tensor, Tensor]:
    """(src, tgt_in) of the first ``limit`` pairs whose source and target fit ``max_len`` tokens with
    their EOS: src = ids + EOS, tgt_in = BOS + ids, right-padded (the encoding of training's batches).
    ValueError when no pair fits."""
    src: list[list[int]] = []
    tgt: list[list[int]] = []
    step = 4 * limit
    for start in range(0, len(pairs), step):  # encode a little at a time: a split may be large
        chunk = pairs[start : start + step]
        for s, t in zip(encode(tok, [p[0] for p in chunk]), encode(tok, [p[1] for p in chunk]), strict=True):
            if len(s) + 1 <= max_len and len(t) + 1 <= max_len and len(src) < limit:
                src.append([*s, EOS_ID])
                tgt.append(t)
        if len(src) == limit:
            break
    if not src:
        raise ValueError(
            f"position diagnostics: none of the {len(pairs)} pairs given fits data.max_len={max_len} "
            "tokens; give a set with shorter sentences (or raise data.max_len)"
        )
    return pad(src), pad(tgt, prefix=BOS_ID)


def merge(parts: list[Distances]) -> Distances:
    """One ``Distances`` over all heads from the parts of several ranks (tensor parallelism: each
    holds a block of heads; data-parallel ranks repeat the same block), columns by global head."""
    columns: dict[int, tuple[Tensor, Tensor]] = {}
    for part in parts:
        for c, head in enumerate(part.heads):
            columns.setdefault(head, (part.encoder[:, c], part.decoder[:, c]))
    heads = sorted(columns)
    encoder = torch.stack([columns[h][0] for h in heads], dim=1)
    decoder = torch.stack([columns[h][1] for h in heads], dim=1)
    return Distances(encoder, decoder, heads)


@dataclass
class Diagnostics:
    """The diagnostics of one model on one batch."""

    distances: Distances
    similarity: dict[str, Tensor]  # side -> (P, P) cosine similarity of its position vectors
    pairs: int  # sentences in the batch

    def scalars(self) -> dict[str, float]:
        """TensorBoard scalars: ``diag/<enc|dec>/layer<l>/head<h>/mean_distance``."""
        out = {}
        for side in SIDES:
            table = self.distances.side(side)
            for layer in range(table.shape[0]):
                for c, head in enumerate(self.distances.heads):
                    out[f"diag/{SHORT[side]}/layer{layer}/head{head}/mean_distance"] = float(table[layer, c])
        return out

    def as_dict(self) -> dict[str, Any]:
        """JSON: the distances per side as [layer][head] lists, and per side with position vectors the
        rows compared and the mean similarity of rows k apart, for k = 0 .. P-1."""
        return {
            "pairs": self.pairs,
            "heads": self.distances.heads,
            "mean_distance": {side: self.distances.side(side).tolist() for side in SIDES},
            "position_similarity": {
                side: {"rows": int(sim.shape[0]), "by_offset": by_offset(sim).tolist()}
                for side, sim in self.similarity.items()
            },
        }

    def table(self) -> str:
        """The distances as a table: one row per side and layer, one column per head, and their mean."""
        heads = self.distances.heads
        header = ["side", "layer", *(f"head {h}" for h in heads), "mean"]
        rows = []
        for side in SIDES:
            table = self.distances.side(side)
            for layer in range(table.shape[0]):
                cells = [f"{v:.2f}" for v in table[layer].tolist()]
                rows.append([side, str(layer), *cells, f"{float(table[layer].mean()):.2f}"])
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [f"mean attention distance (positions), self-attention, {self.pairs} pairs"]
        for row in [header, *rows]:  # side and layer left-aligned, figures right-aligned
            cells = [
                c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
            ]
            lines.append("  ".join(cells))
        for side, sim in self.similarity.items():
            near = by_offset(sim)
            lines.append(
                f"{side} position vectors: {sim.shape[0]} rows; mean cosine similarity of rows 1 apart "
                f"{float(near[1]) if len(near) > 1 else float('nan'):.3f}, 8 apart "
                f"{float(near[8]) if len(near) > 8 else float('nan'):.3f}"
            )
        return "\n".join(lines)


def by_offset(sim: Tensor) -> Tensor:
    """Mean of ``sim[i, i + k]`` over i, for k = 0 .. P-1 (P,)."""
    size = sim.shape[0]
    return torch.stack([torch.diagonal(sim, offset=k).mean() for k in range(size)])


def diagnose(
    model: Transformer,
    src: Tensor,
    tgt_in: Tensor,
    length: int,
    *,
    heads: list[int] | None = None,
    learned_only: bool = False,
    cast: torch.dtype | None = None,
) -> Diagnostics:
    """The diagnostics of ``model`` on (src, tgt_in), moved to the model's device; ``length``: the
    positions compared for an encoding without a limit of its own (sinusoidal); ``heads``: see
    ``attention_distances``; ``learned_only``: similarity of learned position vectors only (a fixed
    encoding's never changes); ``cast``: under autocast to this dtype (as training computes)."""
    device = next(model.parameters()).device
    with torch.autocast(device.type, dtype=cast) if cast is not None else contextlib.nullcontext():
        distances = attention_distances(model, src.to(device), tgt_in.to(device), heads)
        similarity = position_similarity(model, length, learned_only)
    return Diagnostics(distances, similarity, int(src.shape[0]))


def similarity_image(sim: Tensor, side: int = IMAGE_SIDE) -> np.ndarray:
    """(H, W, 3) uint8 RGB of a cosine-similarity matrix: -1 blue, 0 white, 1 red (matplotlib's RdBu_r);
    a matrix larger than ``side`` is averaged down to side x side."""
    from matplotlib import colormaps

    if sim.shape[0] > side:
        sim = F.adaptive_avg_pool2d(sim[None, None].float(), side)[0, 0]
    rgba = colormaps["RdBu_r"](((sim.float().clamp(-1, 1) + 1) / 2).numpy())
    return (np.asarray(rgba)[..., :3] * 255).round().astype(np.uint8)


# --------------------------------------------------------------------------------------------------
# tpe-eval --diagnostics


def report_diagnostics(
    model: Transformer,
    tok: Tokenizer,
    max_len: int,
    pairs: list[Pair],
    out: str | Path | None,
    file: IO[str] | None = None,
) -> Diagnostics:
    """``tpe-eval --diagnostics``: measure ``model`` on the first pairs of ``pairs`` (``max_len``: the
    checkpoint's data.max_len), write ``diagnostics.json`` and ``position-similarity-<side>.png`` into
    ``out`` (None: the working directory) and print the table to ``file`` (stdout)."""
    src, tgt_in = diagnostic_batch(tok, pairs, max_len)
    diag = diagnose(model, src, tgt_in, max_len)
    folder = Path(out) if out is not None else Path.cwd()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / JSON_NAME).write_text(json.dumps(diag.as_dict(), indent=1) + "\n")
    from matplotlib import image

    for side, sim in diag.similarity.items():
        image.imsave(folder / f"position-similarity-{side}.png", similarity_image(sim, sim.shape[0]))
    print(diag.table(), file=file or sys.stdout)
    return diag
