"""KERPLE, Sandwich, FIRE and xPos: golden values from the papers' formulas written out as loops over
(i, j), and the fast checks that the slow training tests make of the older encodings."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from support.golden_positions import outputs
from support.models import tiny_model
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from tpe_train.config import ConfigError, load_config
from tpe_train.evaluation.position_settings import apply_position_settings
from tpe_train.model.loss import label_smoothed_loss
from tpe_train.model.transformer import Transformer
from tpe_train.positions import PositionArgs, PositionEncoding, build_position
from tpe_train.positions.contextual import ContextualPosition
from tpe_train.positions.fire import FirePosition
from tpe_train.positions.kernel import KERPLE_EPS, KERPLE_INIT_MARGIN, KerpleLog, KerplePower

NEW = ["kerple_log", "kerple_power", "sandwich", "fire", "xpos", "cope"]
Q_POS, K_POS = torch.arange(3, 9), torch.arange(1, 10)  # offsets, queries inside a longer key range


def args(causal: bool, sandwich_dim: int = 128) -> PositionArgs:
    return PositionArgs(d_model=32, n_heads=4, causal=causal, sandwich_dim=sandwich_dim)


def trained(kind: str, causal: bool) -> PositionEncoding:
    """The encoding with its parameters moved off their initial values."""
    torch.manual_seed(0)
    enc = build_position(kind, args(causal))
    with torch.no_grad():
        for param in enc.parameters():
            param.add_(torch.randn_like(param) * 0.3)
    return enc


def bias(enc: PositionEncoding, lq: int = 6) -> torch.Tensor:
    out = enc.attn_bias(torch.zeros(1, 4, lq, 8), Q_POS, K_POS)
    assert out is not None
    return out[0]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("form", ["log", "power"])
def test_kerple_matches_the_kernel_formula(form: str, causal: bool) -> None:
    enc = trained(f"kerple_{form}", causal)
    assert isinstance(enc, KerpleLog | KerplePower)
    r1, r2 = (t.tolist() for t in enc.params())
    assert min(r1 + r2) > KERPLE_EPS - 1e-7 and (form == "log" or max(r2) <= 2)
    got = bias(enc)
    for h in range(4):
        for a, i in enumerate(Q_POS.tolist()):
            for b, j in enumerate(K_POS.tolist()):
                d = abs(i - j)
                want = -r1[h] * math.log(1 + r2[h] * d) if form == "log" else -r1[h] * d ** r2[h]
                assert got[h, a, b].item() == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_kerple_starts_from_the_reference_draws() -> None:
    torch.manual_seed(1)
    log = build_position("kerple_log", PositionArgs(d_model=512, n_heads=256, causal=False))
    power = build_position("kerple_power", PositionArgs(d_model=512, n_heads=256, causal=False))
    assert isinstance(log, KerpleLog) and isinstance(power, KerplePower)
    for value, top in zip((*log.params(), *power.params()), (2.0, 1.0, 1.0, 2.0), strict=True):
        assert float(value.min()) >= KERPLE_EPS and float(value.max()) <= top
        assert float(value.mean()) == pytest.approx(top / 2, abs=0.15 * top)  # uniform on (0, top)


def test_kerple_parameters_stay_within_the_references_clamps() -> None:
    """The reference clamps r1, r2 (and the power form's exponent) at 0.01 from below and the exponent
    at 2 from above; draws below 0.01 start just above it (KERPLE_INIT_MARGIN)."""
    torch.manual_seed(1)
    power = build_position("kerple_power", PositionArgs(d_model=8192, n_heads=4096, causal=False))
    assert isinstance(power, KerplePower)
    low = [float(v.detach().min()) for v in power.params()]
    assert all(
        KERPLE_EPS < v <= KERPLE_EPS + KERPLE_INIT_MARGIN * 1.001 for v in low
    )  # 4,096 draws: some low
    with torch.no_grad():
        power.r2.fill_(-1e4)  # the optimizer pushed the exponent's raw value far down
    assert float(power.params()[1].min()) == pytest.approx(KERPLE_EPS, abs=1e-7)
    with torch.no_grad():
        power.r2.fill_(1e4)
    assert float(power.params()[1].max()) == pytest.approx(2.0, abs=1e-6)


def test_sandwich_matches_the_sinusoid_product_scaled_per_head() -> None:
    dim = 16
    enc = build_position("sandwich", args(False, sandwich_dim=dim))
    got = bias(enc)
    for h in range(4):
        for a, i in enumerate(Q_POS.tolist()):
            for b, j in enumerate(K_POS.tolist()):
                product = sum(math.cos((i - j) / 10000 ** (2 * k / dim)) for k in range(1, dim // 2 + 1))
                want = (product - dim / 2) / (8 * (h + 1) / 4)
                assert got[h, a, b].item() == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert torch.equal(bias(build_position("sandwich", args(True, sandwich_dim=dim))), got)


@pytest.mark.parametrize("causal", [False, True])
def test_fire_matches_the_mlp_of_the_normalised_distance(causal: bool) -> None:
    enc = trained("fire", causal)
    assert isinstance(enc, FirePosition)
    c, m = abs(float(enc.c)), float(enc.multiplier)
    threshold = abs(m * 512.0)
    w1, b1 = enc.hidden.weight[:, 0].tolist(), enc.hidden.bias.tolist()
    # a threshold below the positions, so that max(L, i) takes i for some queries
    got = bias(enc)
    with torch.no_grad():
        enc.multiplier.fill_(5.0 / 512)
    small = bias(enc)
    for out, L in ((got, threshold), (small, 5.0)):
        for a, i in enumerate(Q_POS.tolist()):
            for b, j in enumerate(K_POS.tolist()):
                x = math.log(c * abs(i - j) + 1) / (math.log(c * max(L, i, j) + 1) + 1e-6)
                hidden = [max(0.0, w * x + bb) for w, bb in zip(w1, b1, strict=True)]
                side = enc.right if (j > i and enc.right is not None) else enc.left
                for h in range(4):
                    row = side.weight[h].tolist()
                    want = sum(r * v for r, v in zip(row, hidden, strict=True)) + float(side.bias[h])
                    assert out[h, a, b].item() == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert (enc.right is None) == causal


def test_fire_feeds_its_mlp_inputs_within_0_and_1_at_any_length_on_both_sides() -> None:
    """The two-sided form normalises by psi(max(L, i, j)): keys after an early query, far beyond L, stay
    within [0, 1]; keys at or before the query keep the paper's psi(max(L, i))."""
    enc = build_position("fire", PositionArgs(d_model=16, n_heads=4, causal=False, fire_threshold=8.0))
    assert isinstance(enc, FirePosition)
    pos = torch.arange(200)
    with torch.no_grad():
        x = enc.normalised(pos, pos)
    assert float(x.min()) >= 0 and float(x.max()) <= 1.0
    c, i, j = 0.1, pos[:, None].double(), pos[None, :].double()
    paper = torch.log1p(c * (i - j).abs()) / (torch.log1p(c * torch.clamp(i, min=8.0)) + 1e-6)
    before = j <= i
    torch.testing.assert_close(x.double()[before], paper[before], rtol=1e-6, atol=1e-7)
    assert float(paper[~before].max()) > 1.5  # what the query's normaliser alone gave after it


def test_xpos_in_fp16_is_refused_where_its_key_scale_leaves_fp16s_range() -> None:
    from tpe_train.positions.rotary import XposPosition

    limit = XposPosition.fp16_positions(512.0)
    enc = build_position("xpos", PositionArgs(d_model=16, n_heads=1, causal=True))
    assert isinstance(enc, XposPosition)
    scale = enc.decay(torch.tensor([limit, limit + 200]), -1.0)  # the keys' zeta^(-j/gamma)
    assert float(scale[0].max()) * XposPosition.FP16_HEADROOM <= 65504.0
    assert float(scale[1].max()) * XposPosition.FP16_HEADROOM > 65504.0
    load_config("demo", ["model.position.kind=xpos", "train.fp16=true"])  # translation lengths: fine
    load_config("demo", ["model.position.kind=xpos", "train.bf16=true", "data.max_len=4000"])
    load_config("demo", ["model.position.kind=xpos", "train.fp16=true", "data.max_len=4000",
                         "model.position.decoder=false"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"xpos under train\.fp16.*use train\.bf16"):
        load_config("demo", ["model.position.kind=xpos", "train.fp16=true", "data.max_len=4000"])


def test_xpos_scores_decay_per_frequency_pair_in_the_decoder_only() -> None:
    hd, gamma = 8, 512.0
    q, k = torch.randn(1, 1, 6, hd, dtype=torch.float64), torch.randn(1, 1, 9, hd, dtype=torch.float64)
    dec = build_position("xpos", PositionArgs(d_model=hd, n_heads=1, causal=True))
    qr, kr = dec.rotate(q, k, Q_POS, K_POS)
    got = (qr @ kr.transpose(-1, -2))[0, 0]
    half = hd // 2
    for a, i in enumerate(Q_POS.tolist()):
        for b, j in enumerate(K_POS.tolist()):
            want = 0.0
            for p in range(half):  # the pair (p, p + hd/2) rotates by theta_p and decays by zeta_p
                theta = 10000.0 ** (-2 * p / hd)
                zeta = (2 * p / hd + 0.4) / 1.4
                x1, y1 = float(q[0, 0, a, p]), float(q[0, 0, a, p + half])
                x2, y2 = float(k[0, 0, b, p]), float(k[0, 0, b, p + half])
                angle = (j - i) * theta  # RoPE: q_i . k_j = q^T R((j - i) theta) k
                rotated = (x1 * x2 + y1 * y2) * math.cos(angle) + (y1 * x2 - x1 * y2) * math.sin(angle)
                want += rotated * zeta ** ((i - j) / gamma)
            assert got[a, b].item() == pytest.approx(want, rel=1e-5, abs=1e-5)
    enc = build_position("xpos", PositionArgs(d_model=hd, n_heads=1, causal=False))
    rope = build_position("rope", PositionArgs(d_model=hd, n_heads=1, causal=False))
    for x, y in zip(enc.rotate(q, k, Q_POS, K_POS), rope.rotate(q, k, Q_POS, K_POS), strict=True):
        assert torch.equal(x, y)  # the encoder: RoPE, bitwise


@pytest.mark.parametrize("divide", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_cope_matches_the_gated_counts_between_query_and_key(causal: bool, divide: bool) -> None:
    """The term q_i . e[p_ij], divided by sqrt(hd) = 2 as the authors' code divides it with q . k (their
    default), or not (their --cope-nodiv: cope_divide=false)."""
    torch.manual_seed(0)
    args = PositionArgs(d_model=8, n_heads=2, causal=causal, cope_positions=5, cope_divide=divide)
    enc = build_position("cope", args)
    assert isinstance(enc, ContextualPosition)
    with torch.no_grad():
        enc.table.normal_()
    length, pos = 6, torch.arange(2, 8)  # positions with an offset
    q, k = torch.randn(1, 2, length, 4) * 2, torch.randn(1, 2, length, 4) * 2
    keep = torch.ones(1, 1, 1, length, dtype=torch.bool)
    keep[..., 4] = False  # a padded key counts nothing
    got = enc.key_bias(q, k, pos, pos, keep)[0]
    table = enc.table.detach()
    for h in range(2):
        for a in range(length):
            for b in range(length):
                seen = [t for t in range(min(a, b), max(a, b) + 1) if t != 4 and (t <= a or not causal)]
                p = sum(1 / (1 + math.exp(-float(q[0, h, a] @ k[0, h, t]) / 2)) for t in seen)
                p = min(p, 4.0)
                lo, hi = math.floor(p), math.ceil(p)
                at = [float(q[0, h, a] @ table[:, c]) for c in (lo, hi)]
                want = (at[1] * (p - lo) + at[0] * (1 - (p - lo))) / (2 if divide else 1)  # sqrt(hd)
                assert got[h, a, b].item() == pytest.approx(want, rel=1e-4, abs=1e-5)


def cope_model(**kw: object) -> Transformer:
    """A tiny CoPE model with its tables drawn (they start at zero, which would hide the term)."""
    torch.manual_seed(0)
    model = tiny_model("cope", **kw)
    for enc in model.modules():
        if isinstance(enc, ContextualPosition):
            torch.nn.init.normal_(enc.table)
    return model


def test_cope_decodes_incrementally_as_the_full_pass_and_flex_equals_sdpa() -> None:
    src, tgt = torch.randint(3, 40, (3, 7)), torch.randint(3, 40, (3, 6))
    src[1, 5:] = 0
    model = cope_model()
    with torch.no_grad():
        memory = model.encode(src)
        full = model.decode(tgt, memory)
        cache = model.new_cache()
        chunks = [model.decode(tgt[:, :2], memory, cache)] + [
            model.decode(tgt[:, i : i + 1], memory, cache) for i in range(2, 6)
        ]
        torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=1e-5, rtol=1e-5)
        outs = [cope_model(attention=b)(src, tgt) for b in ("explicit", "sdpa", "flex")]
        torch.manual_seed(0)
        zero_tables = tiny_model("cope", attention="explicit")(src, tgt)  # the same weights, no CoPE term
    assert not torch.allclose(outs[0], zero_tables, atol=1e-3)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-5, rtol=1e-5)


def test_cope_is_refused_in_cross_attention() -> None:
    with pytest.raises(ConfigError, match="cross=cope: CoPE counts keys from the query's own position"):
        load_config("demo", ["model.position.cross=cope"])


@pytest.mark.parametrize("kind", NEW)
def test_a_step_reads_nothing_back_to_the_host(kind: str) -> None:
    """Forward and backward under fake tensors (no data: a read would raise), as the training step."""
    src, tgt = torch.randint(3, 40, (2, 7)), torch.randint(3, 40, (2, 6))
    with FakeTensorMode() as mode:
        model = tiny_model(kind).train()
        fake_src, fake_tgt = mode.from_tensor(src), mode.from_tensor(tgt)
        loss, _, ntok = label_smoothed_loss(model(fake_src, fake_tgt), fake_tgt, 0, 0.1)
        (loss / ntok).backward()
        with pytest.raises(DataDependentOutputException):
            float(loss)


@pytest.mark.parametrize("kind", NEW)
def test_bf16_autocast_gives_finite_gradients_to_every_position_parameter(kind: str) -> None:
    model = tiny_model(kind).train()
    src, tgt = torch.randint(3, 40, (2, 7)), torch.randint(3, 40, (2, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(src, tgt)
    loss, _, ntok = label_smoothed_loss(logits, tgt, 0, 0.1)
    (loss / ntok).backward()
    params = [p for n, p in model.named_parameters() if "positions" in n]
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in params)
    assert (kind in ("sandwich", "xpos")) == (not params)
    assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in params) or not params


def test_the_config_types_and_checks_the_new_keys() -> None:
    cfg = load_config("demo", ["model.position.kind=fire", "model.position.fire_width=8"])
    args = cfg.model.args(40, 0, 1, 2).position
    assert args is not None and args.fire_width == 8 and args.sandwich_dim == 128
    with pytest.raises(ConfigError, match=r"sandwich_dim \(7\) must be even"):
        load_config("demo", ["model.position.kind=sandwich", "model.position.sandwich_dim=7"])
    with pytest.raises(ConfigError, match="xpos needs an even head dimension"):
        load_config("demo", ["model.position.kind=xpos", "model.d_model=12", "model.n_heads=4"])
    with pytest.raises(ConfigError, match="fire_threshold"):
        load_config("demo", ["model.position.kind=fire", "model.position.fire_threshold=0"])


#: How far the stored outputs may lie from this machine's. They were computed on one processor with
#: PyTorch's kernels (MKL); another processor, or oneDNN (``train.cpu_gemm=onednn``, what ``auto``
#: takes on AVX-512 processors not made by Intel), sums each product's terms in another order, which
#: moves fp32 results by a few units in the last place: with oneDNN forced on the machine that stored
#: them, 16 of the 32 outputs (every incremental decoding) differ, by at most 1.1e-6 at magnitudes up
#: to 3.6 (about 5 units in the last place). The bound is 10x that: a sinusoidal table's base of 10,001
#: in place of 10,000 moves that encoding's outputs by 1.4e-5 and fails the test; RoPE's base of 10,001
#: moves them by 3.9e-6, which no comparison across processors can tell from rounding.
STORED_TOLERANCE = 1e-5


def test_the_older_encodings_give_the_outputs_of_the_narrower_interface() -> None:
    """Widening the interface for keys (CoPE) leaves every older encoding's outputs unchanged: the
    values the code gave before (tests/support/golden_positions.py), within fp32 rounding of another
    summation order (``STORED_TOLERANCE``)."""
    golden = torch.load(Path(__file__).parent / "support" / "golden_positions.pt")
    now = outputs()
    assert sorted(now) == sorted(golden) and len(now) == 32
    off = {key: float((now[key] - golden[key]).abs().max()) for key in golden}
    assert max(off.values()) <= STORED_TOLERANCE, {key: d for key, d in off.items() if d > STORED_TOLERANCE}


def test_fire_takes_a_test_time_threshold() -> None:
    model = tiny_model("fire")
    src, tgt = torch.randint(3, 40, (2, 9)), torch.randint(3, 40, (2, 6))
    with torch.no_grad():
        before = model(src, tgt)
        for enc in model.modules():
            if isinstance(enc, FirePosition):
                enc.multiplier.fill_(4.0 / 512)  # a trained L of 4: queries past it normalise by psi(i)
        trained = model(src, tgt)
        apply_position_settings(model, ["fire.threshold=4"])
        assert torch.equal(model(src, tgt), trained)  # the same L, given: bitwise the same
        apply_position_settings(model, ["fire.threshold=64"])
        assert not torch.allclose(model(src, tgt), trained, atol=1e-4)
        apply_position_settings(model, ["fire.threshold=512"])
        torch.testing.assert_close(model(src, tgt), before)  # L0 = 512: the initial threshold
    with pytest.raises(ValueError, match=r"fire\.threshold=-1\.0: give a positive threshold"):
        apply_position_settings(model, ["fire.threshold=-1"])


def test_xpos_takes_ropes_test_time_settings() -> None:
    model = tiny_model("xpos")
    src, tgt = torch.randint(3, 40, (2, 9)), torch.randint(3, 40, (2, 6))
    with torch.no_grad():
        trained = model(src, tgt)
        apply_position_settings(model, ["xpos.scaling=ntk", "xpos.factor=1"])
        assert torch.equal(model(src, tgt), trained)  # factor 1: bitwise the model
        apply_position_settings(model, ["xpos.scaling=ntk", "xpos.factor=4"])
        assert not torch.allclose(model(src, tgt), trained, atol=1e-4)


@pytest.mark.parametrize("kind", ["kerple_log", "kerple_power", "sandwich"])
def test_a_test_time_distance_scale_reads_the_trained_bias_at_scaled_distances(kind: str) -> None:
    enc = trained(kind, causal=False)
    q = torch.zeros(1, 4, 6, 8)
    plain = bias(enc)
    enc.adapt(distance_scale="1")
    assert torch.equal(bias(enc), plain)  # 1: bitwise
    enc.adapt(distance_scale="2")
    doubled = enc.attn_bias(q, 2 * Q_POS, 2 * K_POS)
    assert doubled is not None
    torch.testing.assert_close(doubled[0], plain)  # twice as far, the same bias
    assert not torch.allclose(bias(enc), plain)
    with pytest.raises(ValueError, match=r"distance_scale=0\.0: give a positive factor"):
        enc.adapt(distance_scale="0")
    model = tiny_model(kind)
    src, tgt = torch.randint(3, 40, (2, 9)), torch.randint(3, 40, (2, 6))
    with torch.no_grad():
        before = model(src, tgt)
        assert apply_position_settings(model, [f"{kind}.distance_scale=1"])
        assert torch.equal(model(src, tgt), before)


def test_flex_takes_the_test_time_distance_scale_as_the_dense_path() -> None:
    src, tgt = torch.randint(3, 40, (2, 9)), torch.randint(3, 40, (2, 6))
    outs = []
    for backend in ("explicit", "flex"):
        torch.manual_seed(0)
        model = tiny_model("kerple_power", attention=backend)
        apply_position_settings(model, ["kerple_power.distance_scale=3"])
        with torch.no_grad():
            outs.append(model(src, tgt))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
