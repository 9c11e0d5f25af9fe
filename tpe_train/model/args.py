"""Architecture arguments of the encoder-decoder (plain data; the model never sees the run config)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tpe_train.positions import PositionArgs


@dataclass(frozen=True, kw_only=True)
class ModelArgs:
    """Shape of one encoder-decoder Transformer over a joint vocabulary."""

    vocab_size: int
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    d_model: int = 512
    n_heads: int = 8
    ffn_dim: int = 2048
    encoder_layers: int = 6
    decoder_layers: int = 6
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    pre_norm: bool = False
    encoder_position: str = "sinusoidal"  # encoding of encoder self-attention
    decoder_position: str = "sinusoidal"  # encoding of decoder self-attention
    cross_position: str = "none"  # encoding of decoder-encoder attention
    attention: str = "auto"  # attention backend: auto | flex | sdpa | explicit (model.attention)
    position: PositionArgs | None = None  # encoding parameters; d_model/n_heads filled in

    def position_args(self, causal: bool) -> PositionArgs:
        base = self.position or PositionArgs(d_model=self.d_model, n_heads=self.n_heads, causal=causal)
        return replace(base, d_model=self.d_model, n_heads=self.n_heads, causal=causal)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads
