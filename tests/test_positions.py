"""Golden values and invariances of the position encodings."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch
from support.models import tiny_model

from tpe_train.positions import POSITIONS, PositionArgs, build_position
from tpe_train.positions.absolute import sinusoid_table
from tpe_train.positions.relative import alibi_slopes, t5_bucket

RELATIVE = ["shaw", "t5", "alibi"]


def args(causal: bool = False, **kw: object) -> PositionArgs:
    return PositionArgs(d_model=32, n_heads=4, causal=causal, **kw)  # type: ignore[arg-type]


def test_sinusoidal_matches_formula() -> None:
    d = 16
    table = sinusoid_table(torch.arange(50), d)
    for pos in (0, 1, 7, 49):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_sinusoidal_embed_adds_table_at_offset_positions() -> None:
    enc = build_position("sinusoidal", args())
    x = torch.zeros(1, 3, 32)
    out = enc.embed(x, torch.arange(5, 8))
    torch.testing.assert_close(out[0], sinusoid_table(torch.arange(5, 8), 32))


def test_t5_bucket_boundaries_bidirectional() -> None:
    # 32 buckets, max distance 128, bidirectional: 16 per sign, 8 exact, then log-spaced.
    rel = torch.tensor([0, -1, -7, -8, -11, -12, -127, -128, -1000, 1, 7, 8, 128])
    got = t5_bucket(rel, bidirectional=True, num_buckets=32, max_distance=128).tolist()
    # key before query (negative): buckets 0..15; key after query: 16 + same.
    assert got == [0, 1, 7, 8, 8, 9, 15, 15, 15, 17, 23, 24, 31]


def test_t5_bucket_causal_ignores_future() -> None:
    rel = torch.tensor([0, -1, -15, -16, -20, -128, 5])
    got = t5_bucket(rel, bidirectional=False, num_buckets=32, max_distance=128).tolist()
    assert got == [0, 1, 15, 16, 17, 31, 0]


def test_alibi_slopes_golden() -> None:
    assert alibi_slopes(8) == pytest.approx([2.0 ** -(i + 1) for i in range(8)])
    twelve = [2.0 ** -(i + 1) for i in range(8)] + [2.0 ** -(0.5 + i) for i in range(4)]
    assert alibi_slopes(12) == pytest.approx(twelve)


def test_alibi_bias_is_linear_symmetric_distance() -> None:
    enc = build_position("alibi", args())
    q = torch.zeros(1, 4, 5, 8)
    bias = enc.attn_bias(q, torch.arange(5), torch.arange(5))
    assert bias is not None
    slopes = torch.tensor(alibi_slopes(4))
    for i in range(5):
        for j in range(5):
            torch.testing.assert_close(bias[0, :, i, j], -slopes * abs(i - j))


def test_shaw_clipping_and_equals_materialised_computation() -> None:
    enc = build_position("shaw", args(shaw_clip=2))
    idx = enc.bucket(torch.arange(6), torch.arange(6))  # type: ignore[operator]
    assert idx[0].tolist() == [2, 3, 4, 4, 4, 4]  # j - i = 0, 1, 2, 3(clipped), ...
    assert idx[5].tolist() == [0, 0, 0, 0, 1, 2]
    q = torch.randn(2, 4, 6, 8)
    bias = enc.attn_bias(q, torch.arange(6), torch.arange(6))
    # The naive (L, L, d) reference of Shaw et al.: e_ij = q_i . a_ij / sqrt(d).
    a = enc.keys[idx]  # type: ignore[index]  # (L, L, d)
    ref = torch.einsum("bhid,ijd->bhij", q, a) / math.sqrt(8)
    torch.testing.assert_close(bias, ref)


def test_shaw_relative_values_match_materialised_computation() -> None:
    enc = build_position("shaw", args(shaw_clip=2, shaw_values=True))
    assert enc.needs_weights
    torch.nn.init.normal_(enc.values)  # type: ignore[arg-type]
    w = torch.softmax(torch.randn(2, 4, 5, 5), dim=-1)
    got = enc.value_term(w, torch.arange(5), torch.arange(5))
    a_v = enc.values[enc.bucket(torch.arange(5), torch.arange(5))]  # type: ignore[index, operator]
    torch.testing.assert_close(got, torch.einsum("bhij,ijd->bhid", w, a_v))


@pytest.mark.parametrize("kind", RELATIVE)
@pytest.mark.parametrize("causal", [False, True])
def test_relative_biases_depend_only_on_distance(kind: str, causal: bool) -> None:
    enc = build_position(kind, args(causal=causal, shaw_clip=3))
    q = torch.randn(1, 4, 6, 8)
    base = enc.attn_bias(q, torch.arange(6), torch.arange(6))
    shifted = enc.attn_bias(q, torch.arange(6) + 37, torch.arange(6) + 37)
    assert base is not None and shifted is not None
    torch.testing.assert_close(base, shifted)
    assert not torch.allclose(base, torch.zeros_like(base))


def test_rope_matches_the_rotary_formula_at_offset_positions() -> None:
    """Golden values from the formula itself (Su et al. 2021), in the half-split layout: dimension
    i < hd/2 pairs with i + hd/2, rotated by the angle pos * base^(-2i/hd)."""
    base, hd = 500.0, 8
    enc = build_position("rope", PositionArgs(d_model=16, n_heads=2, causal=False, rope_base=base))
    q, k = torch.randn(1, 2, 3, hd, dtype=torch.float64), torch.randn(1, 2, 4, hd, dtype=torch.float64)
    q_pos, k_pos = torch.tensor([37, 38, 39]), torch.tensor([0, 5, 38, 1000])  # offsets, a far key
    rq, rk = enc.rotate(q, k, q_pos, k_pos)
    for x, rx, pos in ((q, rq, q_pos), (k, rk, k_pos)):
        for t, p in enumerate(pos.tolist()):
            for i in range(hd // 2):
                angle = p * base ** (-2 * i / hd)
                c, s = math.cos(angle), math.sin(angle)
                a, b = x[0, 1, t, i].item(), x[0, 1, t, i + hd // 2].item()
                assert rx[0, 1, t, i].item() == pytest.approx(a * c - b * s, abs=1e-6)
                assert rx[0, 1, t, i + hd // 2].item() == pytest.approx(b * c + a * s, abs=1e-6)


def test_rope_scores_depend_only_on_distance() -> None:
    enc = build_position("rope", args())
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 4, 6, 8)
    pos = torch.arange(6)
    q0, k0 = enc.rotate(q, k, pos, pos)
    q1, k1 = enc.rotate(q, k, pos + 100, pos + 100)
    torch.testing.assert_close(q0 @ k0.transpose(-1, -2), q1 @ k1.transpose(-1, -2), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(q0, q)  # it does rotate


@pytest.mark.parametrize("kind", ["t5", "alibi"])
def test_head_slices_union_equals_full_bias(kind: str) -> None:
    enc = build_position(kind, args())
    q = torch.randn(1, 4, 5, 8)
    full = enc.attn_bias(q, torch.arange(5), torch.arange(5))
    parts = []
    for rank_heads in ([0, 1], [2, 3]):  # what each of two tensor-parallel ranks keeps
        part = copy.deepcopy(enc)
        part.keep_heads(rank_heads)
        parts.append(part.attn_bias(q[:, rank_heads], torch.arange(5), torch.arange(5)))
        stored = sum(t.numel() for t in [*part.parameters(), *part.buffers()])
        assert stored == sum(t.numel() for t in [*enc.parameters(), *enc.buffers()]) // 2
    assert full is not None and all(p is not None for p in parts)
    torch.testing.assert_close(torch.cat(parts, dim=1), full)  # type: ignore[arg-type]


def test_learned_longer_input_is_a_clear_error() -> None:
    # The model refuses it from the shape, before any lookup (the encoding never reads a position
    # back from the device).
    model = tiny_model("learned", position=replace(tiny_model("learned").args.position, max_positions=8))
    with pytest.raises(ValueError, match=r"source sequence of 9 positions.*max_positions=8"):
        model.encode(torch.ones(1, 9, dtype=torch.long))
    memory = model.encode(torch.ones(1, 5, dtype=torch.long))
    cache = model.new_cache()
    model.decode(torch.ones(1, 8, dtype=torch.long), memory, cache)  # positions 0..7: fits
    with pytest.raises(ValueError, match="target sequence of 9 positions"):
        model.decode(torch.ones(1, 1, dtype=torch.long), memory, cache)


def test_registry_lists_choices_on_a_typo() -> None:
    with pytest.raises(KeyError, match="choose one of: none, sinusoidal, learned"):
        POSITIONS.get("rotary")
    assert set(POSITIONS.names()) == {
        *("none", "sinusoidal", "learned", "shaw", "t5", "rope", "alibi"),
        *("kerple_log", "kerple_power", "sandwich", "fire", "xpos", "cope"),
    }
