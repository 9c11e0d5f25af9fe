"""Figures of the docs that restate a preset (batch, micro-batch, steps, model size, warm-up, learning
rate) equal the preset, read through the real config loader. One row of FIGURES per figure: the page,
a regular expression whose group is the figure (lines joined, so that a figure may wrap), the preset
and its config key."""

from __future__ import annotations

import re
from functools import cache

import pytest
from support.docs import ROOT

from tpe_train.config import load_config

FIGURES = [
    ("docs/wmt14.md", r"(\d+) \+ \d+ layers", "wmt14_en_de_base", "model.encoder_layers"),
    ("docs/wmt14.md", r"\d+ \+ (\d+) layers", "wmt14_en_de_base", "model.decoder_layers"),
    ("docs/wmt14.md", r"d_model ([\d,]+)", "wmt14_en_de_base", "model.d_model"),
    ("docs/wmt14.md", r"(\d+) heads", "wmt14_en_de_base", "model.n_heads"),
    ("docs/wmt14.md", r"FFN ([\d,]+)", "wmt14_en_de_base", "model.ffn_dim"),
    ("docs/wmt14.md", r"([\d,]+) target tokens a step", "wmt14_en_de_base", "train.batch_tokens"),
    ("docs/wmt14.md", r"micro-batches of ([\d,]+) padded", "wmt14_en_de_base", "data.max_tokens"),
    ("docs/wmt14.md", r"checkpoints every ([\d,]+) steps", "wmt14_en_de_base", "train.save_every"),
    ("docs/wmt14.md", r"([\d,]+)-step warm-up", "wmt14_en_de_base", "train.warmup_steps"),
    ("README.md", r"\| 1 x 1 \| ([\d,]+) \(", "wmt14_en_de_base", "data.max_tokens"),
    ("docs/demo.md", r"small Transformer \(d_model ([\d,]+)", "demo", "model.d_model"),
    ("docs/demo.md", r"small Transformer \(d_model \d+, (\d+) heads", "demo", "model.n_heads"),
    ("docs/demo.md", r"small Transformer \(d_model \d+, \d+ heads, (\d+) \+", "demo", "model.encoder_layers"),
    ("docs/demo.md", r"small Transformer .{0,160}? for ([\d,]+) steps", "demo", "train.max_steps"),
    (
        "docs/study.md",
        r"`multi30k_en_de` is the recipe .{0,160}?d_model ([\d,]+)",
        "multi30k_en_de",
        "model.d_model",
    ),
    (
        "docs/study.md",
        r"`multi30k_en_de` is the recipe .{0,160}?([\d,]+) bf16 steps",
        "multi30k_en_de",
        "train.max_steps",
    ),
    (
        "docs/study.md",
        r"`multi30k_en_de_cpu` is sized .{0,160}?d_model ([\d,]+)",
        "multi30k_en_de_cpu",
        "model.d_model",
    ),
    (
        "docs/study.md",
        r"`multi30k_en_de_cpu` is sized .{0,160}?([\d,]+) steps",
        "multi30k_en_de_cpu",
        "train.max_steps",
    ),
    ("docs/benchmarks.md", r"`wmt14_en_de_big` model \(d_model ([\d,]+)", "wmt14_en_de_big", "model.d_model"),
    (
        "docs/benchmarks.md",
        r"`wmt14_en_de_big` model .{0,160}?(\d+) heads",
        "wmt14_en_de_big",
        "model.n_heads",
    ),
    (
        "docs/benchmarks.md",
        r"`wmt14_en_de_big` model .{0,160}?FFN ([\d,]+)",
        "wmt14_en_de_big",
        "model.ffn_dim",
    ),
    (
        "docs/benchmarks.md",
        r"`wmt14_en_de_big` model .{0,160}?dropout ([\d.]+)",
        "wmt14_en_de_big",
        "model.dropout",
    ),
    (
        "docs/benchmarks.md",
        r"`wmt14_en_de_base` model \(d_model ([\d,]+)",
        "wmt14_en_de_base",
        "model.d_model",
    ),
    (
        "docs/benchmarks.md",
        r"`wmt14_en_de_base` model .{0,160}?FFN ([\d,]+)",
        "wmt14_en_de_base",
        "model.ffn_dim",
    ),
    ("README.md", r"`multi30k_en_de` \(d_model ([\d,]+)", "multi30k_en_de", "model.d_model"),
    ("README.md", r"`multi30k_en_de` \(d_model \d+, (\d+) \+", "multi30k_en_de", "model.encoder_layers"),
    ("README.md", r"`multi30k_en_de` \(d_model .{0,160}?dropout ([\d.]+)", "multi30k_en_de", "model.dropout"),
    (
        "README.md",
        r"`multi30k_en_de` \(d_model .{0,160}?([\d,]+) bf16 steps",
        "multi30k_en_de",
        "train.max_steps",
    ),
]


@cache
def text(page: str) -> str:
    return " ".join((ROOT / page).read_text().split())  # a figure may wrap


def value(preset: str, key: str) -> float:
    node = load_config(preset, [])
    for part in key.split("."):
        node = getattr(node, part)
    return float(node)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("page", "pattern", "preset", "key"), FIGURES, ids=[f"{f[0]}:{f[3]}" for f in FIGURES]
)
def test_a_figure_restating_a_preset_equals_it(page: str, pattern: str, preset: str, key: str) -> None:
    found = re.search(pattern, text(page))
    assert found is not None, f"{page}: no figure for {key} ({pattern!r}); update the table of this test"
    written = float(found.group(1).replace(",", ""))
    assert written == value(preset, key), (
        f"{page}: {found.group(0)!r}, but {preset} has {key}={value(preset, key)}"
    )
