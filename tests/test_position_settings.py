"""Test-time position settings (``--position``): each method against its paper's formula, computed
here independently in plain math, the identity setting bitwise equal to the untouched model, and the
option's parsing, application and errors."""

from __future__ import annotations

import math

import pytest
import torch
from support.models import tiny_model

from tpe_train.evaluation.cli import eval_args, translate_args
from tpe_train.evaluation.position_settings import apply_position_settings, parse_position_settings
from tpe_train.positions import PositionArgs, build_position
from tpe_train.positions.relative import alibi_slopes

HD = 16
ARGS = PositionArgs(d_model=64, n_heads=4, causal=False, rope_base=10000.0)


def rope_theta(scaling: str, s: float, original: int = 0) -> list[float]:
    """theta_i per Chen et al. 2023 (PI), bloc97 (NTK-aware) and Peng et al. 2023 (YaRN, eq. 19-21)."""
    base = 10000.0 * s ** (HD / (HD - 2)) if scaling == "ntk" else 10000.0
    out = []
    for i in range(HD // 2):
        theta = base ** (-2 * i / HD)
        if scaling == "pi":
            theta /= s
        elif scaling == "yarn":
            r = original / (2 * math.pi / theta)
            gamma = 0.0 if r < 1 else 1.0 if r > 32 else (r - 1) / 31
            theta = (1 - gamma) * theta / s + gamma * theta
        out.append(theta)
    return out


@pytest.mark.parametrize("scaling", ["pi", "ntk", "yarn"])
def test_rope_scaling_matches_formula(scaling: str) -> None:
    enc = build_position("rope", ARGS)
    enc.adapt(scaling=scaling, factor="4", original="64")
    pos = torch.tensor([0, 1, 5, 200])
    cos, sin = enc.cos_sin(pos)
    m = 0.1 * math.log(4) + 1 if scaling == "yarn" else 1.0
    theta = rope_theta(scaling, 4.0, 64)
    want_cos = [[m * math.cos(p * theta[j % (HD // 2)]) for j in range(HD)] for p in pos.tolist()]
    want_sin = [[m * math.sin(p * theta[j % (HD // 2)]) for j in range(HD)] for p in pos.tolist()]
    assert torch.allclose(cos, torch.tensor(want_cos), atol=1e-6)
    assert torch.allclose(sin, torch.tensor(want_sin), atol=1e-6)


def test_yarn_ramp_covers_both_ends_and_temperature_scales_logits() -> None:
    enc = build_position("rope", ARGS)
    enc.adapt(scaling="yarn", factor="8", original="512")
    theta = enc.inv_freq(torch.device("cpu")).tolist()
    plain = rope_theta("none", 1.0)
    assert theta[0] == pytest.approx(plain[0])  # high frequency: extrapolated, unchanged
    assert theta[-1] == pytest.approx(plain[-1] / 8)  # low frequency: interpolated
    q = torch.randn(1, 1, 3, HD)
    qr, kr = enc.rotate(q, q.clone(), torch.arange(3), torch.arange(3))
    ident = build_position("rope", ARGS)
    q0, k0 = ident.rotate(q, q.clone(), torch.arange(3), torch.arange(3))
    # the temperature: |q| and |k| each times 0.1 ln s + 1, so the logits times its square
    assert qr.norm() / q0.norm() == pytest.approx(0.1 * math.log(8) + 1, rel=1e-5)
    assert (qr * kr).sum() / (q0 * k0).sum() != pytest.approx(1.0)


def test_alibi_slope_scale() -> None:
    enc = build_position("alibi", ARGS)
    enc.adapt(slope_scale="0.5")
    bias = enc.attn_bias(torch.zeros(1, 4, 3, HD), torch.arange(3), torch.arange(3))
    assert bias is not None
    start = 2 ** (-8 / 4)
    want = [[[-0.5 * start ** (h + 1) * abs(i - j) for j in range(3)] for i in range(3)] for h in range(4)]
    assert torch.allclose(bias[0], torch.tensor(want))
    assert alibi_slopes(4)[0] == pytest.approx(start)


def t5_ref(rel: int, bidirectional: bool, nb: int, maxd: int, limit: int) -> int:
    """T5's bucket (Raffel et al. 2020), continued past ``maxd`` at the same log spacing up to ``limit``."""
    half = nb // 2 if bidirectional else nb
    exact = half // 2
    per_log = (half - exact) / math.log(maxd / exact)
    count = exact + math.ceil(per_log * math.log(limit / exact) - 1e-9)  # buckets per sign, extended
    offset = count if bidirectional and rel > 0 else 0
    d = abs(rel) if bidirectional else max(-rel, 0)
    last = count - 1
    if d < exact:
        return offset + d
    return offset + min(exact + int(math.log(d / exact) * per_log), last)


@pytest.mark.parametrize("causal", [False, True])
def test_t5_max_distance_keeps_trained_buckets(causal: bool) -> None:
    args = PositionArgs(d_model=32, n_heads=4, causal=causal, t5_buckets=32, t5_max_distance=128)
    enc = build_position("t5", args)
    rel = torch.arange(-1100, 1100)
    before = enc.bucket(rel)
    enc.adapt(max_distance="1024")
    after = enc.bucket(rel)
    for r in range(-1100, 1100, 7):
        scaled = math.log(max(abs(r), 1) / 8) / math.log(128 / 8) * 8
        if abs(scaled - round(scaled)) < 1e-6:  # a bucket's edge: float32 and float64 may differ
            continue
        assert int(after[r + 1100]) == t5_ref(r, not causal, 32, 128, 1024), r
    weights = enc.weights()
    trained = enc.table.weight
    below = rel.abs() < 128
    assert torch.equal(weights[after[below]], trained[before[below]])  # same bias below the old limit
    assert weights.shape[0] > trained.shape[0]
    w = trained.detach()
    half = 32 if causal else 16
    # fill=linear: the first added bucket is the last trained one plus its step from the one before
    assert torch.allclose(weights[half], w[half - 1] + (w[half - 1] - w[half - 2]))


def test_learned_interpolation() -> None:
    args = PositionArgs(d_model=4, n_heads=1, causal=False, max_positions=5)
    enc = build_position("learned", args)
    with pytest.raises(ValueError, match="interpolate"):
        enc.adapt(factor="2")
    enc.adapt(extend="interpolate", factor="2")
    assert enc.max_length == 10
    w = enc.table.weight.detach().tolist()
    x = torch.zeros(1, 10, 4)
    out = enc.embed(x, torch.arange(10))[0]
    for i in range(10):
        p = i / 2
        lo, hi = min(int(p), 4), min(int(p) + 1, 4)
        frac = min(p - int(p), 1.0)
        want = [(1 - frac) * w[lo][c] + frac * w[hi][c] for c in range(4)]
        assert out[i].tolist() == pytest.approx(want, abs=1e-6)


IDENTITY = {
    "rope": ["rope.scaling=yarn", "rope.factor=1"],
    "alibi": ["alibi.slope_scale=1"],
    "t5": ["t5.max_distance=16"],
    "learned": ["learned.extend=interpolate", "learned.factor=1"],
    "shaw": [],
    "sinusoidal": [],
}


@pytest.mark.parametrize("kind", sorted(IDENTITY))
def test_identity_setting_is_bitwise_the_untouched_model(kind: str) -> None:
    torch.manual_seed(0)
    model = tiny_model(kind)
    src, tgt = torch.randint(3, 40, (2, 9)), torch.randint(3, 40, (2, 7))
    with torch.no_grad():
        before = model.decode(tgt, model.encode(src))
        assert apply_position_settings(model, IDENTITY[kind], original=64) or not IDENTITY[kind]
        after = model.decode(tgt, model.encode(src))
    assert torch.equal(before, after)
    assert set(model.state_dict()) == set(tiny_model(kind).state_dict())


def test_cli_option_parses_and_applies_per_side() -> None:
    items = ["rope.scaling=ntk", "rope.factor=2", "side=encoder"]
    assert eval_args(["--checkpoint", "c", *[a for i in items for a in ("--position", i)]]).position == items
    assert translate_args(["--checkpoint", "c", "--position", "alibi.slope_scale=0.5"]).position == [
        "alibi.slope_scale=0.5"
    ]
    assert parse_position_settings(items) == (["encoder"], {"rope": {"scaling": "ntk", "factor": "2"}})
    model = tiny_model("rope")
    assert apply_position_settings(model, items) == ["encoder: rope.scaling=ntk rope.factor=2"]
    assert model.encoder.pos(0).scaling == "ntk"
    assert model.decoder.pos(0).scaling == "none"
    model = tiny_model("rope", cross_position="rope")
    done = apply_position_settings(model, ["rope.scaling=yarn", "rope.factor=2"], original=64)
    assert [line.split(":")[0] for line in done] == ["encoder", "decoder", "cross"]
    assert model.decoder.cross_pos(0).original == 64


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (["rope.factor"], "KEY=VALUE"),
        (["wave.factor=2"], "ENCODING.SETTING"),
        (["side=middle"], "encoder, decoder, cross or both"),
        (["alibi.slope_scale=0.5"], "no alibi encoding"),
        (["rope.speed=2"], "valid: factor, original, scaling"),
        (["rope.scaling=linear"], "none, pi, ntk or yarn"),
        (["rope.factor=two"], "not a valid float"),
        (["rope.scaling=yarn", "rope.factor=2"], "rope.original"),
        (["shaw.clip=8"], "no test-time setting"),
    ],
)
def test_clear_errors(items: list[str], message: str) -> None:
    kind = "shaw" if items[0].startswith("shaw") else "rope"
    with pytest.raises(ValueError, match=message):
        apply_position_settings(tiny_model(kind), items)
