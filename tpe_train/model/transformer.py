"""The encoder-decoder Transformer of Vaswani et al. 2017, single-device and parallelism-blind.

Post-norm by default (the paper), pre-norm as an option; one joint vocabulary whose embedding serves
the source, the target and the output layer; a causal decoder with an incremental KV cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tpe_train.model.args import ModelArgs
from tpe_train.model.attention import Attention, KVCache, Mask
from tpe_train.model.dropout import dropout
from tpe_train.model.kernels import Linear, linear
from tpe_train.positions import POSITIONS, PositionEncoding, build_position


class FeedForward(nn.Module):
    """Position-wise FFN: ``fc_out(dropout(relu(fc_in(x))))``."""

    def __init__(self, d_model: int, ffn_dim: int, dropout: float) -> None:
        super().__init__()
        self.fc_in = Linear(d_model, ffn_dim)
        self.fc_out = Linear(ffn_dim, d_model)
        self.dropout = dropout

    def forward(self, x: Tensor) -> Tensor:
        return self.fc_out(dropout(F.relu(self.fc_in(x)), self.dropout, self.training))


class Layer(nn.Module):
    """One encoder layer (self-attention + FFN) or decoder layer (+ cross-attention)."""

    def __init__(self, args: ModelArgs, cross: bool) -> None:
        super().__init__()
        d = args.d_model
        self.pre_norm = args.pre_norm
        self.dropout = args.dropout
        self.self_attn = Attention(d, args.n_heads, args.attention_dropout, args.attention)
        self.self_norm = nn.LayerNorm(d)
        self.cross_attn = (
            Attention(d, args.n_heads, args.attention_dropout, args.attention) if cross else None
        )
        self.cross_norm = nn.LayerNorm(d) if cross else None
        self.ffn = FeedForward(d, args.ffn_dim, args.activation_dropout)
        self.ffn_norm = nn.LayerNorm(d)

    def _residual(self, x: Tensor, norm: nn.LayerNorm, fn: Callable[[Tensor], Tensor]) -> Tensor:
        if self.pre_norm:
            return x + dropout(fn(norm(x)), self.dropout, self.training)
        return norm(x + dropout(fn(x), self.dropout, self.training))

    def forward(
        self,
        x: Tensor,
        pos: PositionEncoding,
        mask: Mask,
        memory: Memory | None = None,
        cross_pos: PositionEncoding | None = None,
        cross_mask: Mask | None = None,
        cache: dict[str, KVCache] | None = None,
    ) -> Tensor:
        """x: (B, L, D); ``memory``: the encoder's output, for a decoder layer; ``mask`` and
        ``cross_mask``: positions, padding and causality of self- and cross-attention."""
        self_cache = cache["self"] if cache is not None else None
        x = self._residual(x, self.self_norm, lambda h: self.self_attn(h, pos, mask, cache=self_cache))
        cross_attn, cross_norm = self.cross_attn, self.cross_norm
        if cross_attn is not None and cross_norm is not None:
            assert memory is not None and cross_pos is not None and cross_mask is not None
            cross_cache = cache["cross"] if cache is not None else None
            x = self._residual(
                x,
                cross_norm,
                lambda h: cross_attn(h, cross_pos, cross_mask, memory=memory.states, cache=cross_cache),
            )
        return self._residual(x, self.ffn_norm, self.ffn)


def _positions(kind: str, args: ModelArgs, n_layers: int, causal: bool) -> nn.ModuleList:
    count = n_layers if POSITIONS.get(kind).per_layer else 1
    return nn.ModuleList(build_position(kind, args.position_args(causal)) for _ in range(count))


class Stack(nn.Module):
    """A stack of layers with its own position encoding(s): shared, or one per layer."""

    def __init__(self, args: ModelArgs, n_layers: int, decoder: bool) -> None:
        super().__init__()
        kind = args.decoder_position if decoder else args.encoder_position
        self.decoder = decoder
        self.positions = _positions(kind, args, n_layers, causal=decoder)
        self.cross_positions = (
            _positions(args.cross_position, args, n_layers, causal=False) if decoder else None
        )
        self.layers = nn.ModuleList(Layer(args, cross=decoder) for _ in range(n_layers))
        self.final_norm = nn.LayerNorm(args.d_model) if args.pre_norm else None
        self.dropout = args.dropout
        self.__dict__["_compiled"] = None  # compile_layers: not a submodule (no state_dict entries)

    def pos(self, i: int) -> PositionEncoding:
        enc = self.positions[i if len(self.positions) > 1 else 0]
        assert isinstance(enc, PositionEncoding)
        return enc

    def cross_pos(self, i: int) -> PositionEncoding | None:
        if self.cross_positions is None:
            return None
        enc = self.cross_positions[i if len(self.cross_positions) > 1 else 0]
        assert isinstance(enc, PositionEncoding)
        return enc

    def forward(
        self,
        x: Tensor,
        mask: Mask,
        memory: Memory | None = None,
        cross_mask: Mask | None = None,
        cache: list[dict[str, KVCache]] | None = None,
    ) -> Tensor:
        """x: (B, L, D) scaled token embeddings at positions ``mask.q_pos`` (L,)."""
        x = dropout(self.pos(0).embed(x, mask.q_pos), self.dropout, self.training)
        if cache is None:  # flex block masks: built here once for all layers, outside compiled code
            first = self.layers[0]
            assert isinstance(first, Layer)
            first.self_attn.prepare(self.pos(0), mask, x.shape[0], x.shape[1])
            cross_pos = self.cross_pos(0)
            if first.cross_attn is not None and cross_pos is not None and cross_mask is not None:
                first.cross_attn.prepare(cross_pos, cross_mask, x.shape[0], x.shape[1])
        compiled: list[Any] | None = self.__dict__["_compiled"] if self.training and cache is None else None
        for i, layer in enumerate(self.layers):
            run = compiled[i] if compiled else layer
            x = run(
                x,
                self.pos(i),
                mask,
                memory,
                self.cross_pos(i),
                cross_mask,
                cache[i] if cache is not None else None,
            )
        return self.final_norm(x) if self.final_norm is not None else x

    def compile_layers(self, **options: Any) -> None:
        """Compile each layer's training forward (and so its backward) with ``torch.compile``
        (regional compilation: the layers of a stack share their compiled code). Shapes are dynamic
        from the start: token-bucket batches change batch size and length at every step, and static
        shapes would compile twice before settling. Evaluation and decoding keep the eager layers.

        One ``Layer.forward`` serves both stacks, and dynamic shapes still specialise a few cases
        (encoder or decoder, a padding mask or none, a batch or a length of 1, equal source and target
        lengths): 12 graphs on batches that cover them, more than torch's default ``recompile_limit``
        of 8, past which a new case would run eager for the rest of the run. The limit is raised to
        ``RECOMPILE_LIMIT`` (never lowered)."""
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
        options = {"dynamic": True, **options}
        self.__dict__["_compiled"] = [torch.compile(layer, **options) for layer in self.layers]


#: ``torch._dynamo.config.recompile_limit`` under ``compile_layers``: the compiled layer's cases with
#: room to spare (each costs one compilation, only when a batch first needs it)
RECOMPILE_LIMIT = 32


@dataclass
class DecoderCache:
    """Per-layer KV caches plus the number of target positions already decoded."""

    layers: list[dict[str, KVCache]] = field(default_factory=list)
    offset: int = 0
    #: the decoder self-attention's positions for every step (drawn before the first: randomized
    #: positions at test time), or None: 0, 1, 2, ...
    positions: Tensor | None = None

    @classmethod
    def empty(cls, n_layers: int, positions: Tensor | None = None) -> DecoderCache:
        return cls([{"self": KVCache(), "cross": KVCache()} for _ in range(n_layers)], 0, positions)

    def reorder(self, index: Tensor) -> None:
        """Keep rows ``index`` of the batch (beam search).

        Only self-attention caches move: beam search reorders rows within a sentence, whose rows
        share one encoder output, so the cross-attention keys and values are already in place.
        """
        for layer in self.layers:
            layer["self"].reorder(index)

    def select_sentences(self, rows: Tensor) -> None:
        """Keep the cross-attention memory of sentences ``rows`` (beam search drops finished ones;
        the self-attention caches follow through ``reorder``)."""
        for layer in self.layers:
            layer["cross"].select(rows)


@dataclass
class Memory:
    """Encoder output with its padding mask and positions."""

    states: Tensor  # (B, Ls, D)
    keep: Tensor  # (B, 1, 1, Ls) bool
    positions: Tensor  # (Ls,)
    group: int = 1  # decoder rows per memory row (beam search: the beam size)

    def select(self, rows: Tensor) -> Memory:
        """The memory of sentences ``rows`` only."""
        return Memory(self.states[rows], self.keep[rows], self.positions, self.group)


def _check_length(length: int, limit: int | None, side: str) -> None:
    """Refuse a sequence the position encoding cannot represent, from its shape (no device read)."""
    if limit is not None and length > limit:
        raise ValueError(
            f"a {side} sequence of {length} positions is beyond the learned position table "
            f"(model.position.max_positions={limit}); raise model.position.max_positions or shorten "
            "the input"
        )


class Transformer(nn.Module):
    """Encoder-decoder over one joint vocabulary; embeddings shared by source, target and output."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.d_model, padding_idx=args.pad_id)
        self.encoder = Stack(args, args.encoder_layers, decoder=False)
        self.decoder = Stack(args, args.decoder_layers, decoder=True)
        self.embed_scale = math.sqrt(args.d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform projections and zero biases (fairseq); N(0, d^-1/2) embeddings."""
        for module in self.modules():
            if isinstance(module, nn.Linear):  # kernels.Linear too
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        nn.init.normal_(self.embed.weight, std=self.args.d_model**-0.5)
        with torch.no_grad():
            self.embed.weight[self.args.pad_id].zero_()

    def max_target_length(self) -> int | None:
        """Longest target the decoder's encoding can represent (None: unbounded)."""
        return self.decoder.pos(0).max_length

    def max_source_length(self) -> int | None:
        """Longest source the encoder's encoding can represent (None: unbounded)."""
        return self.encoder.pos(0).max_length

    def encode(self, src: Tensor) -> Memory:
        """src: (B, Ls) token ids, right-padded."""
        _check_length(src.shape[1], self.max_source_length(), "source")
        positions = torch.arange(src.shape[1], device=src.device)  # cross-attention's keys
        keep = (src != self.args.pad_id)[:, None, None, :]  # (B, 1, 1, Ls)
        x = self.embed(src) * self.embed_scale
        own = self.encoder.pos(0).test_positions(positions)  # self-attention's (drawn at test: randomized)
        return Memory(self.encoder(x, Mask(own, own, keep)), keep, positions)

    def decode(self, tgt_in: Tensor, memory: Memory, cache: DecoderCache | None = None) -> Tensor:
        """tgt_in: (B, Lt) decoder input ids (BOS-prefixed) -> logits (B, Lt, V).

        With a cache, ``tgt_in`` holds only the new tokens; positions continue from ``cache.offset``.
        """
        return linear(self.decoder_states(tgt_in, memory, cache), self.embed.weight)  # oneDNN at inference

    def decoder_states(self, tgt_in: Tensor, memory: Memory, cache: DecoderCache | None = None) -> Tensor:
        """The decoder's output (B, Lt, D), before the output layer (see ``decode``)."""
        offset = cache.offset if cache is not None else 0  # a host int: no device read
        end = offset + tgt_in.shape[1]
        _check_length(end, self.max_target_length(), "target")
        positions = torch.arange(offset, end, device=tgt_in.device)
        keys = torch.arange(end, device=tgt_in.device) if offset else positions  # cached prefix + new
        if cache is not None and cache.positions is not None:  # drawn before the first step
            drawn = cache.positions
            if end > drawn.shape[0]:
                raise ValueError(
                    f"decoding step {end} is past the {drawn.shape[0]} positions drawn for this search; "
                    "make the cache with new_cache(source_length, limit) for the search's step limit"
                )
            own_q, own_k = drawn[offset:end], drawn[:end]
        elif cache is None:
            own_q = own_k = self.decoder.pos(0).test_positions(positions)
        else:
            own_q, own_k = positions, keys
        x = self.embed(tgt_in) * self.embed_scale
        h = self.decoder(
            x,
            Mask(own_q, own_k, causal=True),
            memory,
            Mask(positions, memory.positions, memory.keep, group=memory.group),
            cache.layers if cache is not None else None,
        )
        if cache is not None:
            cache.offset += tgt_in.shape[1]
        return h

    def forward(
        self, src: Tensor, tgt_in: Tensor, head: Callable[[Tensor, Tensor], Any] | None = None
    ) -> Any:
        """Teacher-forced logits (B, Lt, V). With ``head``: ``head(h, weight)`` of the decoder's output h
        (B, Lt, D) and the output layer's weight (V, D) instead; the logits are left to it (a loss taken
        in chunks of tokens, ``model/chunked_loss.py``)."""
        if head is None:
            return self.decode(tgt_in, self.encode(src))
        return head(self.decoder_states(tgt_in, self.encode(src)), self.embed.weight)

    def new_cache(self, source_length: int = 0, limit: int = 0) -> DecoderCache:
        """An empty cache for decoding up to ``limit`` steps from sources of ``source_length`` tokens
        (both used only where the decoder draws its positions at test time: randomized positions)."""
        drawn = self.decoder.pos(0).decode_positions(source_length, limit, self.embed.weight.device)
        return DecoderCache.empty(len(self.decoder.layers), drawn)

    def compile_layers(self, **options: Any) -> None:
        """Regional compilation of the training step: every encoder and decoder layer's forward
        and backward through ``torch.compile`` (``train.compile``); see ``Stack.compile_layers``."""
        self.encoder.compile_layers(**options)
        self.decoder.compile_layers(**options)
