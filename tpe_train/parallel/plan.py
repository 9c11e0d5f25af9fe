"""The tensor-parallel plan: which weights DeepSpeed's AutoTP splits, and how the position tables follow.

AutoTP splits the projections by module name (``PARTITION``): q, k, v and FFN-in by columns (output
features, i.e. whole heads and FFN units), attention-out and FFN-out by rows, with the all-reduce
after the row-parallel product. Attention infers its local head count from the shard it is given,
so the model code never knows. AutoTP does not know our position encodings; this file shards them,
by what each encoding declares in ``tp_split``:

- ``heads`` (T5 bias table, ALiBi slopes): each rank keeps the columns/slopes of the heads it owns,
  computed from the global head indices (``PositionEncoding.keep_heads``);
- ``positions`` (learned absolute table): split along positions; a lookup is masked to the rows the
  rank holds and all-reduced, as a vocabulary-parallel embedding does;
- ``replicated`` with parameters (Shaw's relative tables, shared by all heads of a layer): every
  rank holds the table, its gradient from the rank's own heads is summed over the group;
  sinusoidal and RoPE store nothing.

Parameters split here carry ``tensor_model_parallel = True`` (DeepSpeed then counts them on every
rank in the gradient norm) and ``tp_dim``, the dimension along which the full tensor is their
concatenation (used to consolidate an export).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tpe_train.parallel.collectives import ReduceFromGroup, sum_over
from tpe_train.parallel.context import ParallelContext
from tpe_train.parallel.vocab import scale_lookup_gradient
from tpe_train.positions import PositionEncoding

COLUMN = r".*\.(q|k|v|fc_in)\.weight$"
ROW = r".*\.(out|fc_out)\.weight$"

#: AutoTP's ``partition_config`` for our module names; nothing else is split by AutoTP.
PARTITION: dict[str, Any] = {
    "use_default_specs": False,
    "layer_specs": [
        {"patterns": [COLUMN], "partition_type": "column"},
        {"patterns": [ROW], "partition_type": "row"},
    ],
}

#: (pattern, dim) of the tensors AutoTP splits: column weights and biases by rows of the weight,
#: row-parallel weights by columns (their bias is replicated and added after the all-reduce).
AUTOTP_DIMS = [(re.compile(r".*\.(q|k|v|fc_in)\.(weight|bias)$"), 0), (re.compile(ROW), 1)]


class PositionParallelEmbedding(nn.Module):
    """Rows ``[start, start + rows)`` of an absolute position table; a lookup of any position returns
    the full embedding on every rank (masked local lookup + all-reduce)."""

    def __init__(self, full: nn.Embedding, ctx: ParallelContext) -> None:
        super().__init__()
        rows = full.num_embeddings // ctx.tp_size
        self.start, self.rows, self.group = ctx.tp_rank * rows, rows, ctx.tp_group
        with torch.no_grad():
            self.weight = nn.Parameter(full.weight[self.start : self.start + rows].clone())
        mark_split(self.weight, dim=0)

    def forward(self, pos: Tensor) -> Tensor:
        local = pos - self.start
        here = (local >= 0) & (local < self.rows)  # (L,)
        out = F.embedding(local.clamp(0, self.rows - 1), self.weight) * here[:, None].to(self.weight.dtype)
        return ReduceFromGroup.apply(out, self.group)

    def extra_repr(self) -> str:
        return f"rows {self.start}..{self.start + self.rows - 1}"


def mark_split(param: Tensor, dim: int) -> None:
    """Tag a tensor-parallel shard (DeepSpeed's attribute, and the dimension to gather along)."""
    param.tensor_model_parallel = True  # type: ignore[attr-defined]
    param.tp_dim = dim  # type: ignore[attr-defined]


def apply_tensor_parallel(model: nn.Module, ctx: ParallelContext) -> None:
    """Apply the position and vocabulary parts of the plan in place (before the optimizer is built):
    the position tables as their encodings declare, and the tied embedding's gradient for the
    vocabulary-parallel output layer (``parallel/vocab.py``; ``train_step`` takes the loss that way
    under tensor parallelism)."""
    if ctx.tp_size == 1:
        return
    scale_lookup_gradient(getattr(model, "embed"), ctx)  # noqa: B009 - the model's tied embedding
    shard_positions(model, ctx)


def shard_positions(model: nn.Module, ctx: ParallelContext) -> None:
    """Apply the position part of the plan in place (before the optimizer is built)."""
    if ctx.tp_size == 1:
        return
    for module in model.modules():
        if not isinstance(module, PositionEncoding):
            continue
        if module.tp_split == "heads":
            module.keep_heads(ctx.heads(module.args.n_heads))
            for param in module.parameters():
                mark_split(param, dim=param.dim() - 1)  # T5: (buckets, heads)
        elif module.tp_split == "positions":
            table = getattr(module, "table")  # noqa: B009 - the encoding's declared table
            module.table = PositionParallelEmbedding(table, ctx)
        else:
            for param in module.parameters():
                param.register_hook(sum_over(ctx.tp_group))


def split_dim(name: str, param: Tensor) -> int | None:
    """Dimension along which parameter ``name`` is split over tensor-parallel ranks (None: replicated)."""
    dim = getattr(param, "tp_dim", None)
    if dim is not None:
        return int(dim)
    for pattern, axis in AUTOTP_DIMS:
        if pattern.match(name):
            return axis
    return None


def position_bytes(model: nn.Module) -> int:
    """Bytes this rank stores for position encodings: parameters and buffers (ALiBi's slopes)."""
    total = 0
    for module in model.modules():
        if isinstance(module, PositionEncoding):
            for t in [*module.parameters(), *module.buffers()]:
                total += local_numel(t) * t.element_size()
    return total


def local_numel(t: Tensor) -> int:
    """Elements this rank holds (a ZeRO-3 parameter keeps only its partition in ``ds_tensor``)."""
    ds_tensor = getattr(t, "ds_tensor", None)
    return int(ds_tensor.numel()) if ds_tensor is not None else t.numel()
