"""Multi-head attention through ``F.scaled_dot_product_attention``, calling the three position hooks.

The local head count is inferred with ``view(B, L, -1, head_dim)`` so that tensor parallelism can
shard the projections from outside without this file knowing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from tpe_train.model.kernels import Linear, linears
from tpe_train.positions import PositionEncoding


class KVCache:
    """Keys and values of one attention layer during incremental decoding.

    Self-attention appends into time-major buffers (capacity, B, H * hd) that grow by doubling
    (``torch.cat`` per step copied the whole prefix). Time-major, the filled prefix is one contiguous
    block, so beam search's reordering is one ``index_select`` of whole rows into a spare buffer that
    then takes the buffer's place: about 5x faster than reordering (B, H, L, hd) in place, which
    copied twice through a strided view. Attention reads the buffers as (B, H, L, hd) views; the
    matrix products take those strides without copying. Cross-attention stores the projected memory
    once, (B, H, Ls, hd).
    """

    def __init__(self) -> None:
        self.k: Tensor | None = None  # cross-attention: the projected memory
        self.v: Tensor | None = None
        self._k: Tensor | None = None  # self-attention: (capacity, B, H * hd)
        self._v: Tensor | None = None
        self._spare: tuple[Tensor, Tensor] | None = None
        self._heads = 0
        self.length = 0

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add new keys/values (B, H, new, hd); return all of them as (B, H, L, hd) views."""
        batch, heads, new, hd = k.shape
        n = self.length
        if self._k is None or self._v is None or n + new > self._k.shape[0]:
            capacity = max(64, 2 * (n + new))
            grown_k = k.new_empty(capacity, batch, heads * hd)
            grown_v = v.new_empty(capacity, batch, heads * hd)
            if self._k is not None and self._v is not None:
                grown_k[:n] = self._k[:n]
                grown_v[:n] = self._v[:n]
            self._k, self._v, self._spare, self._heads = grown_k, grown_v, None, heads
        self._k[n : n + new] = k.permute(2, 0, 1, 3).reshape(new, batch, heads * hd)
        self._v[n : n + new] = v.permute(2, 0, 1, 3).reshape(new, batch, heads * hd)
        self.length = n + new
        return self._view(self._k), self._view(self._v)

    def _view(self, buffer: Tensor) -> Tensor:
        n, batch = self.length, buffer.shape[1]
        return buffer[:n].view(n, batch, self._heads, -1).permute(1, 2, 0, 3)

    def store(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Keep the projected memory of cross-attention (contiguous once, not copied per step)."""
        self.k, self.v = k.contiguous(), v.contiguous()
        self.length = k.shape[2]
        return self.k, self.v

    def select(self, rows: Tensor) -> None:
        """Keep batch rows ``rows`` of a stored memory (cross-attention)."""
        if self.k is not None and self.v is not None:
            self.k, self.v = self.k[rows], self.v[rows]

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` of the self-attention keys and values (beam search)."""
        if self._k is None or self._v is None:
            return
        n, same = self.length, index.numel() == self._k.shape[1]
        if same:  # same batch: into the spare buffers, then swap
            spare = self._spare or (torch.empty_like(self._k), torch.empty_like(self._v))
        else:  # the batch shrinks (finished sentences leave): new, smaller buffers
            shape = (self._k.shape[0], index.numel(), self._k.shape[2])
            spare = (self._k.new_empty(shape), self._v.new_empty(shape))
        torch.index_select(self._k[:n], 1, index, out=spare[0][:n])
        torch.index_select(self._v[:n], 1, index, out=spare[1][:n])
        self._spare = (self._k, self._v) if same else None
        self._k, self._v = spare


class Attention(nn.Module):
    """Self- or cross-attention with separate q, k, v and out projections."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.head_dim = d_model // n_heads
        self.q = Linear(d_model, d_model)
        self.k = Linear(d_model, d_model)
        self.v = Linear(d_model, d_model)
        self.out = Linear(d_model, d_model)
        self.dropout = dropout

    def _split(self, x: Tensor) -> Tensor:
        b, length, _ = x.shape
        return x.view(b, length, -1, self.head_dim).transpose(1, 2)  # (B, H, L, hd)

    def forward(
        self,
        x: Tensor,
        pos: PositionEncoding,
        q_pos: Tensor,
        k_pos: Tensor,
        *,
        memory: Tensor | None = None,
        keep: Tensor | None = None,
        causal: bool = False,
        cache: KVCache | None = None,
        group: int = 1,
    ) -> Tensor:
        """x: (B, Lq, D); memory: (B, Lk, D) for cross-attention (None: self-attention).

        ``keep``: bool (B, 1, 1, Lk), False at padded keys. ``cache``: this layer's KV cache, filled
        in place (self-attention appends; cross-attention projects the memory once). ``group``: each
        memory row serves that many consecutive rows of ``x`` (the beams of one sentence).
        """
        if memory is None:
            q, k, v = (self._split(t) for t in linears(x, (self.q, self.k, self.v)))
            q, k = pos.rotate(q, k, q_pos, q_pos)
            if cache is not None:
                k, v = cache.append(k, v)
        elif cache is not None and cache.k is not None and cache.v is not None:
            q = self._split(self.q(x))
            k, v = cache.k, cache.v
            q, _ = pos.rotate(q, k[:, :, :0], q_pos, k_pos[:0])
        else:
            q = self._split(self.q(x))
            k, v = self._split(self.k(memory)), self._split(self.v(memory))
            q, k = pos.rotate(q, k, q_pos, k_pos)
            if cache is not None:
                k, v = cache.store(k, v)

        beams = memory is not None and group > 1
        if beams and q.shape[2] == 1:
            # The beams of a sentence attend to one memory: make them its queries, (B, H, K, hd),
            # instead of K copies of the memory (one small GEMM instead of K matrix-vector products).
            rows, heads, _, hd = q.shape
            q = q.view(rows // group, group, heads, hd).transpose(1, 2)
        elif beams:
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
            keep = keep.repeat_interleave(group, 0) if keep is not None else None
            beams = False
        causal = causal and q.shape[2] > 1
        p = self.dropout if self.training else 0.0
        bias = pos.attn_bias(q, q_pos, k_pos) if pos.has_bias else None
        if pos.needs_weights:
            mask = _mask(bias, keep, causal, q_pos, k_pos)
            out = self._explicit(q, k, v, pos, q_pos, k_pos, mask, p)
        elif bias is None and keep is None and causal and q.shape[2] == k.shape[2]:
            out = _sdpa(q, k, v, None, p, is_causal=True)
        elif bias is None and not causal:
            out = _sdpa(q, k, v, keep, p)
        else:
            mask = _mask(bias, keep, causal, q_pos, k_pos)
            assert mask is not None
            out = _sdpa(q, k, v, mask.to(q.dtype), p)
        if beams:
            out = out.transpose(1, 2).reshape(-1, out.shape[1], 1, out.shape[3])  # (B*K, H, 1, hd)
        b, _, length, _ = out.shape
        return self.out(out.transpose(1, 2).reshape(b, length, -1))

    def _explicit(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        pos: PositionEncoding,
        q_pos: Tensor,
        k_pos: Tensor,
        mask: Tensor | None,
        p: float,
    ) -> Tensor:
        """Attention with explicit weights, for encodings that add a weight-dependent value term."""
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.head_dim**-0.5  # (B, H, Lq, Lk)
        if mask is not None:
            scores = scores + mask
        weights = F.dropout(torch.softmax(scores.float(), dim=-1).to(q.dtype), p, self.training)
        return torch.matmul(weights, v) + pos.value_term(weights, q_pos, k_pos)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, p: float, is_causal: bool = False) -> Tensor:
    """``F.scaled_dot_product_attention``; on the CPU restricted to its math backend.

    PyTorch's CPU flash kernel is about 3x slower than the math backend in bf16 at translation
    lengths (forward + backward, (128, 4, 37, 64): 60 ms against 22 ms), which alone ate bf16's gain,
    and slightly slower in fp32 too (24 against 21 ms). For the few queries of an incremental decoding
    step (one token, or the beams of a sentence against its memory) even that costs more than the
    work: plain matmuls are used there. On a GPU every call goes to SDPA's own choice of kernel.
    """
    if q.device.type == "cpu" and q.shape[2] <= 8 and p == 0.0 and not is_causal:
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5)  # (B, H, Lq, Lk)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        return torch.matmul(torch.softmax(scores, dim=-1), v)
    if q.device.type == "cpu":
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=is_causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=is_causal)


def _mask(
    bias: Tensor | None, keep: Tensor | None, causal: bool, q_pos: Tensor, k_pos: Tensor
) -> Tensor | None:
    """Fold bias, key padding and causality into one additive float mask (B|1, H|1, Lq, Lk)."""
    if bias is None and keep is None and not causal:
        return None
    if bias is None:
        mask = torch.zeros(1, 1, q_pos.numel(), k_pos.numel(), device=q_pos.device)
    else:
        mask = bias
    if causal:
        future = k_pos[None, :] > q_pos[:, None]  # (Lq, Lk)
        mask = mask.masked_fill(future, float("-inf"))
    if keep is not None:
        mask = mask.masked_fill(~keep, float("-inf"))
    return mask
