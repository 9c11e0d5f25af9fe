"""The gradient check (tpe_train/model/gradcheck.py) passes correct code and fails planted bugs.

The reference is the ``explicit`` backend in fp64; the candidate here is ``sdpa`` in fp32 on the CPU
(flex has no backward on the CPU: benchmarks/gpu/attention.py runs the same check for flex on a GPU).
"""

from __future__ import annotations

import pytest
import torch
from support.models import KINDS, tiny_model

import tpe_train.positions.relative as relative
from tpe_train.model import gradcheck
from tpe_train.model.transformer import Transformer
from tpe_train.positions.relative import AlibiPosition
from tpe_train.positions.rotary import RotaryPosition

TOL = 1e-4  # fp32 against fp64: measured worst 2e-6 (own norm) over every encoding


def model(variant: str, backend: str, dtype: torch.dtype) -> Transformer:
    torch.manual_seed(0)
    m = tiny_model(variant.split("+")[0], attention=backend, shaw_values=variant == "shaw+values")
    for enc in m.modules():
        if getattr(enc, "values", None) is not None:
            torch.nn.init.normal_(enc.values)  # zero at init: make the value term count
    return m.to(dtype)


def grads(m: Transformer) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    src = torch.randint(3, 40, (3, 9), generator=g)
    src[1, 6:], src[2, 4:] = 0, 0  # padding
    tgt_out = torch.randint(3, 40, (3, 7), generator=g)
    tgt_out[2, 5:] = 0
    tgt_in = torch.cat([torch.ones(3, 1, dtype=torch.long), tgt_out[:, :-1]], dim=1)
    return gradcheck.gradients(m, src, tgt_in, tgt_out, embed=m.embed)


@pytest.mark.parametrize("variant", [*KINDS, "shaw+values"])
def test_fp32_sdpa_gradients_pass_against_the_fp64_explicit_reference(variant: str) -> None:
    ref = grads(model(variant, "explicit", torch.float64))
    ok, errors = gradcheck.check(grads(model(variant, "sdpa", torch.float32)), ref, TOL)
    assert ok, errors[:3]
    zero = {e.name for e in errors if e.against == "global"}
    # the key biases' exact gradient is 0 (the softmax cancels a constant per query): they are held to
    # the global scale; relative to their own norm (rounding noise) they would fail any tolerance
    assert zero and all(name.endswith("k.bias") or ".k.bias" in name for name in zero), zero
    assert {"input:0", "input:1"} <= {e.name for e in errors}


def _plant(bug: str, m: Transformer, monkeypatch: pytest.MonkeyPatch) -> None:
    if bug == "off-by-one distance":  # every relative encoding reads j - i through relative_distance
        monkeypatch.setattr(relative, "relative_distance", lambda q, k: k[None, :] - q[:, None] + 1)
    elif bug == "alibi sign":
        for enc in m.modules():
            if isinstance(enc, AlibiPosition):
                enc.slopes = -enc.slopes
    elif bug == "rope sign":
        real = RotaryPosition.tables

        def negated(self: RotaryPosition, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
            cos, sin = real(self, pos, dtype)
            return cos, -sin

        monkeypatch.setattr(RotaryPosition, "tables", negated)


@pytest.mark.parametrize(
    ("variant", "bug"),
    [
        ("t5", "off-by-one distance"),
        ("shaw", "off-by-one distance"),
        ("shaw+values", "off-by-one distance"),
        ("alibi", "alibi sign"),
        ("rope", "rope sign"),
    ],
)
def test_the_check_catches_a_planted_bug(variant: str, bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = grads(model(variant, "explicit", torch.float64))
    buggy = model(variant, "sdpa", torch.float32)
    _plant(bug, buggy, monkeypatch)
    ok, errors = gradcheck.check(grads(buggy), ref, TOL)
    assert not ok
    assert errors[0].error > 100 * TOL, errors[:3]  # far outside, not a rounding accident


def test_a_tensor_with_a_zero_exact_gradient_is_held_to_the_global_scale() -> None:
    ref = {"w": torch.ones(4, dtype=torch.float64), "k.bias": torch.zeros(4, dtype=torch.float64)}
    noise = {"w": torch.ones(4), "k.bias": torch.full((4,), 1e-7)}
    ok, errors = gradcheck.check(noise, ref, TOL)
    assert ok and {e.name: e.against for e in errors} == {"w": "own", "k.bias": "global"}
    wrong = {"w": torch.ones(4), "k.bias": torch.full((4,), 0.01)}  # not noise: a real gradient
    assert not gradcheck.check(wrong, ref, TOL)[0]
