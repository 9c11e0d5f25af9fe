"""The six newer encodings against their references' own code: ``support/reference_golden.json`` holds
values computed once by the authors' (or the closest published) implementations, with the repository,
path, commit and call of each in its ``sources`` (made by ``support/reference_golden.py``). Each test
builds tpe-train's encoding with the same parameter values and compares the same quantity.

Tolerance: both sides compute in float32 from the same float32 inputs, in different orders (log1p
against log(1 + x), angles in float64 against float32, a fused dot product against the reference's),
on another machine: relative differences of a few float32 roundings (1.2e-7 each), so rtol 1e-5,
and an absolute floor of 1e-6 near entries that cancel to about 0 (larger where a test says why).
The file rounds the values to 8 significant digits (5e-9 relative). Never bitwise.

Where tpe-train differs from a reference on purpose (docs/positions.md, "The newer encodings"), the
tests compare where the two agree: KERPLE, FIRE and CoPE at keys at or before the query (their
references are causal), and xPos through the logits
q_i . k_j (torchscale centres the positions of its scale, tpe-train does not: a shift that cancels in
every logit).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from tpe_train.model.attention import Attention, Mask
from tpe_train.positions import PositionArgs
from tpe_train.positions.contextual import ContextualPosition
from tpe_train.positions.fire import FirePosition
from tpe_train.positions.kernel import KerpleLog, KerplePower, SandwichPosition
from tpe_train.positions.rotary import XposPosition

GOLDEN = Path(__file__).parent / "support" / "reference_golden.json"
RTOL = 1e-5
ATOL = 1e-6


@cache
def golden() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(GOLDEN.read_text())
    return data


def f32(values: list[Any]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def causal_part(t: torch.Tensor) -> torch.Tensor:
    """The entries of keys at or before the query of (..., L, L); 0 above the diagonal."""
    return torch.tril(t)


def test_golden_file_names_its_sources() -> None:
    sources = golden()["sources"]
    assert set(sources) == {"kerple", "sandwich", "fire", "xpos", "cope"}
    for source in sources.values():
        assert len(source["commit"]) == 40 and source["repository"] and source["path"] and source["call"]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("form", ["log", "power"])
def test_kerple_matches_the_authors_code(form: str, causal: bool) -> None:
    """chijames/KERPLE's ParallelKerpleLog / ParallelKerplePower (pos_emb ``kerple_power_ap_``) with
    the same r1, r2 (all above the reference's 0.01 clamp, which leaves them as they are). The
    reference is causal (0 above the diagonal, masked there): both of tpe-train's forms are compared
    at keys at or before the query."""
    g = golden()["kerple"]
    heads, length = g["heads"], g["length"]
    enc = (KerpleLog if form == "log" else KerplePower)(
        PositionArgs(d_model=2 * heads, n_heads=heads, causal=causal)
    )
    with torch.no_grad():
        enc.r1.copy_(enc.raw(f32(g[form]["r1"]), 0))
        enc.r2.copy_(enc.raw(f32(g[form]["r2"]), 1))
    pos = torch.arange(length)
    got = enc.attn_bias(torch.zeros(1, heads, length, 2), pos, pos)
    assert got is not None
    torch.testing.assert_close(causal_part(got[0]), f32(g[form]["bias"]), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("causal", [True, False])
def test_sandwich_matches_nemo(causal: bool) -> None:
    """NeMo's SandwichRelativePositionEmbedding with hidden_size = d': bidirectional for the encoder
    (the whole matrix), not bidirectional for the decoder (keys at or before the query; NeMo puts 0
    above the diagonal, which the causal mask hides). NeMo sums the d'/2 cosines of float32 angles,
    tpe-train in float64: each angle is off by up to 6e-8 |i - j| (5.4e-7 at |i - j| = 9), the sum of
    d'/2 = 8 cosines by up to 4.3e-6, times H / (8h) <= 0.5: atol 5e-6."""
    g = golden()["sandwich"]
    heads, length = g["heads"], g["length"]
    args = PositionArgs(d_model=2 * heads, n_heads=heads, causal=causal, sandwich_dim=g["dim"])
    pos = torch.arange(length)
    got = SandwichPosition(args).attn_bias(torch.zeros(1, heads, length, 2), pos, pos)
    assert got is not None
    want = f32(g["causal" if causal else "bidirectional"])
    torch.testing.assert_close(causal_part(got[0]) if causal else got[0], want, rtol=RTOL, atol=5e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_fire_matches_the_papers_listing(causal: bool) -> None:
    """The FIRE paper's listing (as in mcleish7/arithmetic) with the same MLP, c and L multiplier, L
    below the sequence length so that later queries normalise by psi(i). The listing is causal: both
    forms are compared at keys at or before the query (the two-sided form by its left output layer,
    which it shares with the causal form there)."""
    g = golden()["fire"]
    heads, length = g["heads"], g["length"]
    args = PositionArgs(
        d_model=2 * heads, n_heads=heads, causal=causal, fire_width=g["width"], fire_threshold=g["init_L"]
    )
    enc = FirePosition(args)
    with torch.no_grad():
        enc.hidden.weight.copy_(f32(g["hidden_weight"]))
        enc.hidden.bias.copy_(f32(g["hidden_bias"]))
        enc.left.weight.copy_(f32(g["out_weight"]))
        enc.left.bias.copy_(f32(g["out_bias"]))
        enc.c.fill_(g["c"])
        enc.multiplier.fill_(g["multiplier"])
    pos = torch.arange(length)
    got = enc.attn_bias(torch.zeros(1, heads, length, 2), pos, pos)
    assert got is not None
    torch.testing.assert_close(causal_part(got[0]), causal_part(f32(g["bias"])), rtol=RTOL, atol=ATOL)


def test_xpos_matches_torchscale() -> None:
    """torchscale's XPOS as its MultiheadAttention applies it (queries scaled up, keys down), compared
    through the logits q_i . k_j, which depend on i - j only: torchscale centres the positions of its
    scale and tpe-train does not, a shift that cancels in every logit. Its pairs are interleaved
    (features 2k, 2k+1), tpe-train's half-split (k, k + hd/2): the same inputs are permuted to match.
    The decoder's form (``causal``); the step is the last query alone against all keys (torchscale's
    ``offset``, tpe-train's query position). Each logit sums hd = 8 products of up to ~3 in size whose
    float32 angles (the reference's) are off by up to 6e-8 x 11 positions: atol 1e-5."""
    g = golden()["xpos"]
    rows, length, hd = g["rows"], g["length"], g["head_dim"]
    enc = XposPosition(
        PositionArgs(d_model=rows * hd, n_heads=rows, causal=True, xpos_scale_base=g["scale_base"])
    )

    def half_split(t: torch.Tensor) -> torch.Tensor:  # (rows, L, hd) interleaved -> (1, rows, L, hd)
        return torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)[None]

    q, k = half_split(f32(g["q"])), half_split(f32(g["k"]))
    pos = torch.arange(length)
    q_rot, k_rot = enc.rotate(q, k, pos, pos)
    torch.testing.assert_close((q_rot @ k_rot.transpose(-1, -2))[0], f32(g["logits"]), rtol=RTOL, atol=1e-5)
    step, _ = enc.rotate(q[:, :, -1:], k[:, :, :0], pos[-1:], pos[:0])
    want = f32(g["step_logits"])
    torch.testing.assert_close((step @ k_rot.transpose(-1, -2))[0], want, rtol=RTOL, atol=1e-5)


@pytest.mark.parametrize("case", ["divide", "nodiv", "clamped"])
def test_cope_matches_the_authors_code(case: str) -> None:
    """facebookresearch/RAM's ContextPosSelfAttn under a causal mask against tpe-train's decoder
    self-attention with CoPE (the same projections, output projection the identity): the attention
    weights (explicit backend) and the outputs (explicit and default backends). ``divide``: the
    reference's default, tpe-train's ``cope_divide=true``; ``nodiv``: its ``--cope-nodiv``,
    ``cope_divide=false``; ``clamped``: a table of fewer columns than the counts reach (both clamp to
    the last). The reference is causal; tpe-train's two-sided encoder form has no reference."""
    g = golden()["cope"]
    want = g["cases"][case]
    batch, heads, hd, length = g["batch"], g["heads"], g["head_dim"], g["length"]
    d = heads * hd
    args = PositionArgs(
        d_model=d, n_heads=heads, causal=True, cope_positions=want["npos"], cope_divide=want["divide"]
    )
    enc = ContextualPosition(args).eval()
    attn = Attention(d, heads, dropout=0.0).eval()
    with torch.no_grad():
        enc.table.copy_(f32(g["table"])[:, : want["npos"]])
        for name in ("q", "k", "v"):
            getattr(attn, name).weight.copy_(f32(g[f"w{name}"]))
            getattr(attn, name).bias.copy_(f32(g[f"b{name}"]))
        attn.out.weight.copy_(torch.eye(d))
        attn.out.bias.zero_()
    pos = torch.arange(length)
    x = f32(g["x"])
    assert x.shape == (batch, length, d)
    seen: list[torch.Tensor] = []
    attn.probe = lambda weights, q_pos, k_pos: seen.append(weights)
    with torch.no_grad():
        explicit = attn(x, enc, Mask(pos, pos, causal=True))
        attn.probe = None
        default = attn(x, enc, Mask(pos, pos, causal=True))
    torch.testing.assert_close(seen[0], f32(want["weights"]), rtol=RTOL, atol=ATOL)
    for out in (explicit, default):
        torch.testing.assert_close(out, f32(want["output"]), rtol=RTOL, atol=ATOL)
