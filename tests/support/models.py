"""Tiny models for every registered encoding, shared by the unit tests."""

from __future__ import annotations

from tpe_train.model.args import ModelArgs
from tpe_train.model.transformer import Transformer
from tpe_train.positions import POSITIONS, PositionArgs

KINDS = POSITIONS.names()
#: the encodings that the slow tests (training to a loss, compiling, exporting and decoding) cover; the
#: others are covered there by the fast tests of the same properties (tests/test_position_kernels.py)
TRAINED = ["none", "sinusoidal", "learned", "shaw", "t5", "alibi", "rope"]
#: overrides of the tiniest real `tpe-train` run (seconds on one core): tests that need a real checkpoint
TINY_RUN = [
    "data.synthetic.train_size=300",
    "data.synthetic.test_size=20",
    "data.synthetic.valid_size=20",
    "data.synthetic.long_size=5",
    "data.synthetic.probe_size=5",
    "eval.at_end=false",
    "train.valid_bleu_size=0",
    "train.progress=false",
    "train.threads=1",
    "model.d_model=16",
    "model.n_heads=2",
    "model.ffn_dim=32",
    "model.encoder_layers=1",
    "model.decoder_layers=1",
]


def tiny_model(kind: str, **kw: object) -> Transformer:
    """A 2+2-layer d=32 model over 40 tokens using ``kind`` everywhere it applies."""
    pos = PositionArgs(
        d_model=32,
        n_heads=4,
        causal=False,
        max_positions=64,
        shaw_clip=3,
        t5_buckets=8,
        t5_max_distance=16,
        shaw_values=bool(kw.pop("shaw_values", False)),
    )
    args = dict(
        vocab_size=40,
        d_model=32,
        n_heads=4,
        ffn_dim=64,
        encoder_layers=2,
        decoder_layers=2,
        dropout=0.0,
        encoder_position=kind,
        decoder_position=kind,
        position=pos,
    )
    args.update(kw)
    model = Transformer(ModelArgs(**args))  # type: ignore[arg-type]
    model.eval()
    return model
