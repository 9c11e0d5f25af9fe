"""Shared fixtures: tiny models for every registered encoding."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from tpe_train.model.args import ModelArgs
from tpe_train.model.transformer import Transformer
from tpe_train.positions import POSITIONS, PositionArgs

KINDS = POSITIONS.names()

# Token stores of every test (and of the processes tests start) go to a fresh temporary directory.
os.environ["TPE_DATA_CACHE"] = tempfile.mkdtemp(prefix="tpe-data-")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


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
