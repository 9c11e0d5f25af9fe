"""Multi-head attention behind one call, with three backends; it calls the three position hooks.

The local head count is inferred with ``view(B, L, -1, head_dim)`` so that tensor parallelism can
shard the projections from outside without this file knowing. The position encoding's logit term
reaches every backend through the hooks; attention never branches on an encoding's name.

Backends (``model.attention``; ``choose_backend`` resolves ``auto`` per call):

- ``flex``: ``flex_attention``, on a GPU compiled into one fused kernel (on the CPU unfused, see
  ``_flex``). The encoding's term enters as its ``score_mod`` (a lookup by head, query index and
  key index) and padding + causality as one ``BlockMask`` per batch and attention kind
  (``Mask.block_mask``), built once and shared by every layer: the fused kernel never sees a dense
  (B, H, Lq, Lk) tensor. No dropout on the attention weights. In torch 2.13 FlexAttention has no
  backward pass on the CPU: there it serves evaluation and decoding only.
- ``sdpa``: ``F.scaled_dot_product_attention``. Without a bias it takes the fused kernels
  (``is_causal`` for an unpadded causal square, a boolean key mask otherwise); with a bias the bias,
  padding and causality are folded into one dense float mask (the dense-mask path). On the CPU, bf16
  and float masks take SDPA's formula written out, which measured faster there (``_sdpa``).
- ``explicit``: scores, softmax and the weighted sum written out, with the dense mask: the reference,
  and the one path for encodings that need the weights themselves (Shaw's relative values), whatever
  backend was asked for, and for a call whose weights a diagnostic asks for (``Attention.probe``).
- ``auto``: see ``choose_backend``.

``gpu_route()`` makes the CPU take the GPU's calls (``F.scaled_dot_product_attention``), so that CPU
tests see what a GPU kernel receives (tests/test_gpu_path.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from tpe_train.model.dropout import dropout
from tpe_train.model.kernels import Linear, linears
from tpe_train.positions import PositionEncoding
from tpe_train.positions.base import ScoreMod

#: the values of ``model.attention``
BACKENDS = ("auto", "flex", "sdpa", "explicit")

#: FlexAttention's mask_mod: (batch, head, q_idx, kv_idx) -> bool, True where the key is visible
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def check_flex_dropout(backend: str, dropout: float) -> None:
    """Refuse flex with attention dropout (``flex_attention`` takes none): where the config is loaded,
    and where a model is built without one."""
    if backend == "flex" and dropout > 0:
        raise ValueError(
            f"model.attention=flex has no dropout on the attention weights, but "
            f"model.attention_dropout={dropout}; set model.attention_dropout=0 or choose model.attention=sdpa"
        )


def choose_backend(requested: str, pos: PositionEncoding) -> str:
    """The backend one attention call takes: ``explicit`` for an encoding that needs the weights
    (``needs_weights``: Shaw's relative values), else the one asked for, with ``auto`` taking ``sdpa``
    on every device (it measured fastest on CPU and GPU: docs/attention.md)."""
    if pos.needs_weights:
        return "explicit"
    if requested != "auto":
        return requested
    return "sdpa"


class _Route:
    """Whether ``_sdpa`` calls ``F.scaled_dot_product_attention`` on the CPU too (``gpu_route``)."""

    gpu = False


@contextlib.contextmanager
def gpu_route() -> Iterator[None]:
    """Within it, the CPU takes the GPU's attention call: ``_sdpa`` hands q, k, v and the mask to
    ``F.scaled_dot_product_attention`` exactly as it does on a GPU instead of the CPU's written-out
    formula, so that a CPU test sees what a GPU's kernel receives (dtypes, strides, masks). A switch
    for tests and benchmarks, not a setting: not thread-safe, not for compiled code."""
    before, _Route.gpu = _Route.gpu, True
    try:
        yield
    finally:
        _Route.gpu = before


class Mask:
    """Which keys each query may see, for one attention kind (encoder self-, decoder self- or
    cross-attention) of one batch; the same object serves every layer of the stack.

    Positions carry their offset (incremental decoding); causality compares positions, so a chunk
    of new tokens against a cached prefix is masked exactly as in the full pass."""

    def __init__(
        self,
        q_pos: Tensor,
        k_pos: Tensor,
        keep: Tensor | None = None,
        causal: bool = False,
        group: int = 1,
    ) -> None:
        self.q_pos = q_pos  # (Lq,) query positions
        self.k_pos = k_pos  # (Lk,) key positions
        self.keep = keep  # (B, 1, 1, Lk) bool, False at padded keys
        self.causal = causal
        self.group = group  # cross-attention in beam search: decoder rows per memory row (the beams)
        self.block: BlockMask | None = None  # flex: built by block_mask on first use, then shared
        self._dense: tuple[PositionEncoding, Tensor] | None = None  # see dense()

    def mask_mod(self, q_len: int, repeat: int = 1) -> MaskMod | None:
        """FlexAttention's mask_mod for ``q_len`` queries (None: every key visible). ``repeat``:
        each row of ``keep`` serves that many consecutive batch rows."""
        causal = self.causal and q_len > 1
        if self.keep is None and not causal:
            return None
        return _mask_mod(self.keep, causal, self.q_pos, self.k_pos, repeat)

    def block_mask(self, batch: int, q_len: int, k_len: int, repeat: int = 1) -> BlockMask | None:
        """Padding and causality as one FlexAttention ``BlockMask`` for (batch, q_len, k_len), or None
        when every key is visible. Built on the first call and kept, so all layers share it."""
        if self.block is not None:
            return self.block
        mod = self.mask_mod(q_len, repeat)
        if mod is None:
            return None
        block = create_block_mask(mod, batch, None, q_len, k_len, device=self.k_pos.device)
        self.block = block
        # the local, not self.block: inside a compiled decoding step torch 2.13's dynamo read the
        # attribute just set back as None, and flex ran without the padding mask
        return block

    def dense(
        self, pos: PositionEncoding, bias: Callable[[], Tensor | None], dtype: torch.dtype
    ) -> Tensor | None:
        """The dense additive mask of the sdpa and explicit backends: ``bias()`` (the encoding's logit
        term) with padding and causality folded in, (B|1, H|1, Lq, Lk).

        Attention calls it for an encoding whose bias depends on the positions only and serves every
        layer (``pos.shared_bias``: T5, ALiBi; not for beam search's grouped cross-attention): built
        by the first layer and reused by the others, so that the bias, its masking and the backward of
        both run once per stack instead of once per layer. Not kept inside compiled code (there the
        compiler fuses the recomputation)."""
        if self._dense is not None and self._dense[0] is pos and self._dense[1].dtype == dtype:
            return self._dense[1]
        mask = _mask(bias(), self.keep, self.causal, self.q_pos, self.k_pos, dtype)
        if mask is not None and not torch.compiler.is_compiling():
            self._dense = (pos, mask)
        return mask


def _mask_mod(keep: Tensor | None, causal: bool, q_pos: Tensor, k_pos: Tensor, repeat: int) -> MaskMod:
    """FlexAttention's mask_mod: True where query q_idx of row b may see key kv_idx."""

    def past(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return k_pos[kv_idx] <= q_pos[q_idx]

    if keep is None:
        return past
    rows = keep[:, 0, 0]  # (B, Lk)

    def padding(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return rows[b // repeat, kv_idx]

    def both(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return rows[b // repeat, kv_idx] & (k_pos[kv_idx] <= q_pos[q_idx])

    return both if causal else padding


class _FlexKernel:
    """The fused flex_attention kernel, compiled on first use with dynamic shapes (batches of new
    lengths reuse it)."""

    compiled: Callable[..., Any] | None = None


def _flex(q: Tensor, k: Tensor, v: Tensor, score_mod: ScoreMod | None, block: BlockMask | None) -> Tensor:
    """flex_attention of (B, H, Lq, hd) queries over (B, H, Lk, hd) keys and values.

    On a GPU: the fused kernel ``torch.compile`` generates (Triton). On the CPU: torch's unfused
    implementation of the same ``score_mod`` and ``BlockMask`` (it materialises the scores, as
    ``explicit`` does). torch 2.13's compiled CPU kernel fails to compile these score and mask
    functions with dynamic shapes (C++ errors in its template: ``cur_qSplitSize7`` /
    ``cur_kvSplitSize1`` not declared), and with static shapes it recompiles for every new length,
    i.e. at every decoding step.
    """
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError(
            "model.attention=flex cannot train on the CPU: FlexAttention has no backward pass there "
            "(torch 2.13); set model.attention=auto or sdpa to train, flex serves CPU evaluation and "
            "decoding"
        )
    if q.device.type == "cpu":  # torch warns once that this is the unfused implementation
        out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block)
    else:
        if _FlexKernel.compiled is None:
            _FlexKernel.compiled = torch.compile(flex_attention, dynamic=True)
        out = _FlexKernel.compiled(q, k, v, score_mod=score_mod, block_mask=block)
    assert isinstance(out, Tensor)
    return out


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

    def __init__(self, d_model: int, n_heads: int, dropout: float, backend: str = "auto") -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        check_flex_dropout(backend, dropout)
        self.head_dim = d_model // n_heads
        self.q = Linear(d_model, d_model)
        self.k = Linear(d_model, d_model)
        self.v = Linear(d_model, d_model)
        self.out = Linear(d_model, d_model)
        self.dropout = dropout
        self.backend = backend  # requested; resolved per call by choose_backend
        # q, k, v (cross-attention: k, v) as one product (kernels.linears); off where each projection's
        # weight exists only while its own forward runs (ZeRO-3: Engine turns it off)
        self.fuse_projections = True
        # diagnostics (model/position_stats.py): when set, calls take the explicit backend and hand it
        # their attention probabilities (B, H, Lq, Lk) with the query and key positions
        self.probe: Callable[[Tensor, Tensor, Tensor], None] | None = None

    def _split(self, x: Tensor) -> Tensor:
        b, length, _ = x.shape
        return x.view(b, length, -1, self.head_dim).transpose(1, 2)  # (B, H, L, hd)

    def prepare(self, pos: PositionEncoding, mask: Mask, batch: int, q_len: int) -> None:
        """Build ``mask``'s flex BlockMask now when this layer's calls will use one: once per batch
        for all layers, and outside compiled layers (see ``Stack.forward``)."""
        if mask.group == 1 and choose_backend(self.backend, pos) == "flex":
            mask.block_mask(batch, q_len, mask.k_pos.shape[0])

    def forward(
        self,
        x: Tensor,
        pos: PositionEncoding,
        mask: Mask,
        *,
        memory: Tensor | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """x: (B, Lq, D); memory: (B, Lk, D) for cross-attention (None: self-attention).

        ``mask``: positions, padding and causality of this attention kind (shared by all layers).
        ``cache``: this layer's KV cache, filled in place (self-attention appends; cross-attention
        projects the memory once).
        """
        q_pos, k_pos, keep = mask.q_pos, mask.k_pos, mask.keep
        if memory is None:
            q, k, v = (self._split(t) for t in linears(x, (self.q, self.k, self.v), self.fuse_projections))
            q, k = pos.rotate(q, k, q_pos, q_pos)
            if cache is not None:
                k, v = cache.append(k, v)
        elif cache is not None and cache.k is not None and cache.v is not None:
            q = self._split(self.q(x))
            k, v = cache.k, cache.v
            q, _ = pos.rotate(q, k[:, :, :0], q_pos, k_pos[:0])
        else:
            q = self._split(self.q(x))
            k, v = (self._split(t) for t in linears(memory, (self.k, self.v), self.fuse_projections))
            q, k = pos.rotate(q, k, q_pos, k_pos)
            if cache is not None:
                k, v = cache.store(k, v)

        group = mask.group if memory is not None else 1
        beams, repeat = group > 1 and q.shape[2] == 1, 1
        if beams:
            # The beams of a sentence attend to one memory: make them its queries, (B, H, K, hd),
            # instead of K copies of the memory (one small GEMM instead of K matrix-vector products).
            rows, heads, _, hd = q.shape
            q = q.view(rows // group, group, heads, hd).transpose(1, 2)
            q_pos = q_pos.expand(group)
        elif group > 1:
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
            keep = keep.repeat_interleave(group, 0) if keep is not None else None
            repeat = group
        causal = mask.causal and q.shape[2] > 1
        p = self.dropout if self.training else 0.0
        backend = choose_backend(self.backend, pos) if self.probe is None else "explicit"
        if backend == "flex":
            block = mask.block_mask(q.shape[0], q.shape[2], k.shape[2], repeat)
            out = _flex(q, k, v, pos.score_mod(q, q_pos, k_pos), block)
        else:
            # T5/ALiBi: one dense mask per batch and attention kind, shared by the layers (Mask.dense;
            # its causality is the Mask's: for one decoded query no key lies in its future anyway)
            shared = pos.has_bias and pos.shared_bias and repeat == 1 and not beams
            bias = pos.attn_bias(q, q_pos, k_pos) if pos.has_bias and not shared else None

            def folded() -> Tensor | None:
                if shared:
                    return mask.dense(pos, lambda: pos.attn_bias(q, q_pos, k_pos), q.dtype)
                return _mask(bias, keep, causal, q_pos, k_pos, q.dtype)

            if backend == "explicit":
                out = self._explicit(q, k, v, pos, q_pos, k_pos, folded(), p)
            elif not shared and bias is None and keep is None and causal and q.shape[2] == k.shape[2]:
                out = _sdpa(q, k, v, None, p, is_causal=True)
            elif not shared and bias is None and not causal:
                out = _sdpa(q, k, v, keep, p)
            else:
                dense = folded()
                assert dense is not None
                out = _sdpa(q, k, v, dense, p)
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
        """Attention with explicit weights (the reference; also for encodings whose value term
        needs the weights)."""
        weights = _weights(q, k, mask, p, is_causal=False)
        if self.probe is not None:
            self.probe(weights, q_pos, k_pos)
        out = torch.matmul(weights, v)
        if pos.needs_weights:
            out = out + pos.value_term(weights, q_pos, k_pos)
        return out


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, p: float, is_causal: bool = False) -> Tensor:
    """``F.scaled_dot_product_attention`` on a GPU; on the CPU the math backend or the same formula
    written out (``_written_out``: bf16 scores, softmax in fp32), whichever measured faster for the call
    (docs/cpu-kernels.md#attention): bf16, and fp32 with a float mask (T5, ALiBi, or padding +
    causality), take the formula; fp32 with a boolean mask or none keeps the math backend; PyTorch's
    CPU flash kernel is never used. For the few queries of an incremental decoding step (one token,
    or the beams of a sentence against its memory) the formula is used too (only without gradients,
    so that a compiled training step never specialises on the length).
    """
    if q.device.type != "cpu" or _Route.gpu:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=is_causal)
    small = not torch.is_grad_enabled() and q.shape[2] <= 8  # decoding (training: no length branch)
    float_mask = mask is not None and mask.dtype != torch.bool
    if small or q.dtype != torch.float32 or float_mask:
        return _written_out(q, k, v, mask, p, is_causal)
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=is_causal)


def _written_out(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, p: float, is_causal: bool) -> Tensor:
    """SDPA's formula as matmuls in q's dtype (what ``_sdpa`` takes on the CPU for reduced precision
    and float masks)."""
    return torch.matmul(_weights(q, k, mask, p, is_causal), v)


def _weights(q: Tensor, k: Tensor, mask: Tensor | None, p: float, is_causal: bool) -> Tensor:
    """The attention weights (B, H, Lq, Lk) in q's dtype: scaled scores, the mask (boolean: keep;
    float: added), the softmax in fp32 (fp64 for fp64), then the attention dropout of ``dropout``
    (p is 0 in eval)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5)
    if is_causal:
        future = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).triu_(1)
        scores = scores.masked_fill(future, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32  # fp64: an exact reference
    weights = torch.softmax(scores, dim=-1, dtype=wide).to(q.dtype)
    return dropout(weights, p, p > 0)


def _mask(
    bias: Tensor | None,
    keep: Tensor | None,
    causal: bool,
    q_pos: Tensor,
    k_pos: Tensor,
    dtype: torch.dtype,
) -> Tensor | None:
    """Fold bias, key padding and causality into one additive float mask (B|1, H|1, Lq, Lk) in
    ``dtype`` (the compute dtype: q's), built in it rather than cast per layer."""
    if bias is None and keep is None and not causal:
        return None
    if bias is None:
        mask = torch.zeros(1, 1, q_pos.numel(), k_pos.numel(), dtype=dtype, device=q_pos.device)
    else:
        mask = bias.to(dtype)
    if causal:
        future = k_pos[None, :] > q_pos[:, None]  # (Lq, Lk)
        mask = mask.masked_fill(future, float("-inf"))
    if keep is not None:
        mask = mask.masked_fill(~keep, float("-inf"))
    return mask
