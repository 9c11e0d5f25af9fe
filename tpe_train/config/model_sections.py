"""The model's config sections: the Transformer's shape and its position encoding. Their defaults are the
model's own (``ModelArgs``, ``PositionArgs``), read by name, so each is written once."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import Field, model_validator

from tpe_train.config.section import Section
from tpe_train.config.types import Bool, Float, Int, Text
from tpe_train.model.args import ModelArgs
from tpe_train.model.attention import check_flex_dropout
from tpe_train.positions import POSITIONS, PositionArgs
from tpe_train.positions.augment import check_augment
from tpe_train.positions.rotary import check_head_dim


def _defaults(cls: Any) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


#: The defaults of the model's and the encodings' own arguments: the model and position sections take
#: theirs from these, so each default is written once (in ``model/args.py`` and ``positions/base.py``).
MODEL_DEFAULTS = _defaults(ModelArgs)
POSITION_DEFAULTS = _defaults(PositionArgs)
#: Fields copied as they are from the sections into ``ModelArgs`` / ``PositionArgs``.
MODEL_FIELDS = ("d_model", "n_heads", "ffn_dim", "encoder_layers", "decoder_layers", "dropout",
                "attention_dropout", "activation_dropout", "pre_norm", "attention")  # fmt: skip
POSITION_FIELDS = ("max_positions", "shaw_clip", "shaw_values", "t5_buckets", "t5_max_distance", "rope_base",
                   "sandwich_dim", "fire_width", "fire_threshold", "xpos_scale_base", "cope_positions",
                   "cope_divide", "augment", "augment_max_shift", "cape_shift", "cape_jitter", "cape_scale",
                   "randomized_range", "randomized_per_layer", "randomized_test")  # fmt: skip

#: The built-in encodings (an installed package may register more: docs/positions.md).
_TAKES = "one of " + ", ".join(POSITIONS.names())


class PositionConfig(Section):
    kind: Text = Field(
        MODEL_DEFAULTS["encoder_position"],
        json_schema_extra={"takes": _TAKES},
    )
    """Position encoding: none, sinusoidal, learned, shaw, t5, rope, alibi, kerple_log, kerple_power,
    sandwich, fire, xpos or cope (docs/positions.md)."""
    encoder: Bool = True
    """Use the encoding in encoder self-attention (false: no position information there)."""
    decoder: Bool = True
    """Use the encoding in decoder self-attention (false: no position information there)."""
    cross: Text = Field(
        MODEL_DEFAULTS["cross_position"],
        json_schema_extra={"takes": _TAKES},
    )
    """Encoding of decoder-encoder attention (none in all published setups)."""
    max_positions: Int = Field(POSITION_DEFAULTS["max_positions"], ge=1)
    """learned: rows of the absolute table; the longest sequence it can represent."""
    shaw_clip: Int = Field(POSITION_DEFAULTS["shaw_clip"], ge=1)
    """shaw: relative distances are clipped to [-k, k]."""
    shaw_values: Bool = POSITION_DEFAULTS["shaw_values"]
    """shaw: also add relative value embeddings (explicit attention weights; slower)."""
    t5_buckets: Int = Field(POSITION_DEFAULTS["t5_buckets"], ge=2)
    """t5: number of relative-position buckets."""
    t5_max_distance: Int = Field(POSITION_DEFAULTS["t5_max_distance"], ge=2)
    """t5: distances at or beyond this share the last bucket."""
    rope_base: Float = Field(POSITION_DEFAULTS["rope_base"], gt=1.0)
    """rope, xpos: frequency base theta."""
    augment: Literal["none", "shape", "cape", "randomized"] = POSITION_DEFAULTS["augment"]
    """Training-time position augmentation of the encoder's and decoder's self-attention encoding
    (sinusoidal, learned, rope; evaluation and decoding keep positions 0, 1, 2, ..., except as
    randomized_test says). shape: one random offset per sequence (Kiyono et al. 2021); cape: shift,
    jitter and scale to real positions (Likhomanenko et al. 2021; sinusoidal and rope only);
    randomized: sorted distinct positions drawn from a larger range (Ruoss et al. 2023).
    docs/positions.md, "Position augmentation"."""
    augment_max_shift: Int = Field(POSITION_DEFAULTS["augment_max_shift"], ge=1)
    """shape: the largest offset K; each sequence's offset is uniform over 0..K (learned: the table
    needs max_positions >= data.max_len + 1 + K)."""
    cape_shift: Float = Field(POSITION_DEFAULTS["cape_shift"], ge=0.0)
    """cape: the largest global shift S; each sequence moves by a uniform shift in [-S, S]."""
    cape_jitter: Float = Field(POSITION_DEFAULTS["cape_jitter"], ge=0.0, le=0.5)
    """cape: the largest local jitter e; each position moves by a uniform amount in [-e, e] (at most
    0.5, which keeps the order)."""
    cape_scale: Float = Field(POSITION_DEFAULTS["cape_scale"], ge=1.0)
    """cape: the largest global scale s; each sequence's positions are multiplied by a log-uniform
    factor in [1/s, s] (1: no scaling)."""
    randomized_range: Int = Field(POSITION_DEFAULTS["randomized_range"], ge=2)
    """randomized: positions are drawn from 0..R-1, R > data.max_len + 1 (learned: max_positions >= R)."""
    randomized_per_layer: Bool = POSITION_DEFAULTS["randomized_per_layer"]
    """randomized on rope: draw the positions afresh in every attention layer, as the reference's RoPE
    does (false: one draw per stack and batch, shared by the layers, as sinusoidal and learned add
    theirs once)."""
    randomized_test: Bool = POSITION_DEFAULTS["randomized_test"]
    """randomized: draw self-attention's positions at test time too, as the reference's model does
    whenever it runs (one sorted draw per batch and stack; in decoding, the decoder's drawn for the
    source's length and continued above it). Evaluation restarts the draws from a fixed seed, so it is
    repeatable. false: evaluation and decoding use positions 0, 1, 2, ..., which training never
    showed the model."""
    sandwich_dim: Int = Field(POSITION_DEFAULTS["sandwich_dim"], ge=2)
    """sandwich: d', the width of the sinusoidal embeddings whose inner product is the bias (even)."""
    fire_width: Int = Field(POSITION_DEFAULTS["fire_width"], ge=1)
    """fire: hidden units of the MLP f."""
    fire_threshold: Float = Field(POSITION_DEFAULTS["fire_threshold"], gt=0.0)
    """fire: initial threshold L of the normaliser psi(max(L, i)) (learned through a multiplier)."""
    xpos_scale_base: Float = Field(POSITION_DEFAULTS["xpos_scale_base"], gt=0.0)
    """xpos: gamma, the distance over which a pair's contribution decays by its zeta."""
    cope_positions: Int = Field(POSITION_DEFAULTS["cope_positions"], ge=2)
    """cope: columns of the contextual position table (counts of gated keys; larger counts take the last)."""
    cope_divide: Bool = POSITION_DEFAULTS["cope_divide"]
    """cope: divide the term q.e[p] by sqrt(head dim) together with q.k, as the authors' code does by
    default (false: their --cope-nodiv form, the term added after the division)."""

    @model_validator(mode="after")
    def _known(self) -> PositionConfig:
        for key in ("kind", "cross"):
            name = getattr(self, key)
            broken = POSITIONS.broken(name)  # an installed package's encoding that failed to load
            if broken is not None and name not in POSITIONS:
                raise ValueError(f"model.position.{key}={name!r}: {broken}")
            if name not in POSITIONS:
                raise ValueError(
                    f"model.position.{key}={name!r} is not a position encoding; choose one of: "
                    f"{', '.join(POSITIONS.names())}"
                )
        check_augment(self.kind, POSITIONS.get(self.kind).augments, self.augment)
        if self.cross == "cope":
            raise ValueError(
                "model.position.cross=cope: CoPE counts keys from the query's own position, which the "
                "source sentence does not contain; use cope in self-attention (model.position.kind) "
                "and cross=none"
            )
        if "sandwich" in (self.kind, self.cross) and self.sandwich_dim % 2:
            raise ValueError(
                f"model.position.sandwich_dim ({self.sandwich_dim}) must be even (cosines of d'/2 "
                "frequencies); choose an even width"
            )
        if self.kind == "t5" and self.t5_max_distance <= self.t5_buckets // 2:
            raise ValueError(
                f"model.position.t5_max_distance ({self.t5_max_distance}) must exceed half of "
                f"model.position.t5_buckets ({self.t5_buckets}); raise t5_max_distance"
            )
        return self


class ModelConfig(Section):
    d_model: Int = Field(MODEL_DEFAULTS["d_model"], ge=2)
    """Width of embeddings and residual stream."""
    n_heads: Int = Field(MODEL_DEFAULTS["n_heads"], ge=1)
    """Attention heads; must divide d_model."""
    ffn_dim: Int = Field(MODEL_DEFAULTS["ffn_dim"], ge=1)
    """Inner width of the position-wise feed-forward network."""
    encoder_layers: Int = Field(MODEL_DEFAULTS["encoder_layers"], ge=1)
    """Encoder layers."""
    decoder_layers: Int = Field(MODEL_DEFAULTS["decoder_layers"], ge=1)
    """Decoder layers."""
    dropout: Float = Field(MODEL_DEFAULTS["dropout"], ge=0.0, lt=1.0)
    """Dropout on embeddings and residual branches."""
    attention_dropout: Float = Field(MODEL_DEFAULTS["attention_dropout"], ge=0.0, lt=1.0)
    """Dropout on attention probabilities."""
    activation_dropout: Float = Field(MODEL_DEFAULTS["activation_dropout"], ge=0.0, lt=1.0)
    """Dropout after the FFN activation."""
    pre_norm: Bool = MODEL_DEFAULTS["pre_norm"]
    """Pre-norm layers (LayerNorm before each sublayer) instead of the paper's post-norm."""
    attention: Literal["auto", "flex", "sdpa", "explicit"] = MODEL_DEFAULTS["attention"]
    """Attention backend. auto: sdpa on every device.
    flex: FlexAttention, the encoding's logit term as its score_mod and padding + causality as one
    BlockMask per batch (no attention dropout; cannot train on the CPU). sdpa: PyTorch's fused SDPA
    kernels (with t5/alibi/shaw a dense float mask). explicit: written-out softmax, the reference.
    Shaw with shaw_values always takes explicit (it needs the weights)."""
    position: PositionConfig = Field(default_factory=PositionConfig)
    """Position encoding and its parameters."""

    @model_validator(mode="after")
    def _shape(self) -> ModelConfig:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model ({self.d_model}) is not divisible by model.n_heads ({self.n_heads}); "
                "choose n_heads that divides d_model"
            )
        check_flex_dropout(self.attention, self.attention_dropout)
        rotary = {"rope", "xpos"} & {self.position.kind, self.position.cross}
        if rotary:
            check_head_dim(self.d_model // self.n_heads, min(rotary))
        return self

    def args(self, vocab_size: int, pad_id: int, bos_id: int, eos_id: int) -> ModelArgs:
        """The model's own (config-free) arguments."""
        p = self.position
        position = PositionArgs(
            d_model=self.d_model,
            n_heads=self.n_heads,
            causal=False,
            **{name: getattr(p, name) for name in POSITION_FIELDS},
        )
        return ModelArgs(
            vocab_size=vocab_size,
            pad_id=pad_id,
            bos_id=bos_id,
            eos_id=eos_id,
            encoder_position=p.kind if p.encoder else "none",
            decoder_position=p.kind if p.decoder else "none",
            cross_position=p.cross,
            position=position,
            **{name: getattr(self, name) for name in MODEL_FIELDS},
        )
