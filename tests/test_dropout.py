"""The CPU dropout of ``tpe_train/model/dropout.py``: its drop rate, its scale, its gradient, and the
same masks from the same seed at any thread count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpe_train.model.dropout import dropout, keep_mask


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_drops_p_of_the_elements_and_keeps_the_expectation(p: float) -> None:
    torch.manual_seed(0)
    n = 1_000_003  # not a multiple of the four masks one draw gives
    x = torch.ones(n)
    y = dropout(x, p, training=True)
    kept = y != 0
    # binomial sd of the kept fraction: sqrt(p (1 - p) / n) < 5e-4; 4 sd of margin
    assert abs(kept.double().mean().item() - (1 - p)) < 2e-3
    scale = 65536 / (65536 - round(p * 65536))  # the kept elements' factor: 1 / the exact keep rate
    assert torch.equal(y[kept], torch.full_like(y[kept], scale))
    assert abs(y.double().mean().item() - 1.0) < 4e-3


def test_the_gradient_goes_through_the_kept_elements_with_their_scale() -> None:
    torch.manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(8, 37, 64, dtype=dtype, requires_grad=True)
        y = dropout(x, 0.3, training=True)
        g = torch.randn_like(y)
        y.backward(g)
        keep = y.detach() != 0
        factor = 65536 / (65536 - round(0.3 * 65536))  # a Python float, as in the layer
        assert x.grad is not None and y.dtype == dtype
        assert torch.equal(x.grad, torch.where(keep, g * factor, torch.zeros((), dtype=dtype)))
        assert torch.equal(y.detach(), torch.where(keep, x.detach() * factor, torch.zeros((), dtype=dtype)))


def test_a_seed_gives_the_same_masks_at_any_thread_count() -> None:
    threads = torch.get_num_threads()
    masks = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            torch.manual_seed(7)
            masks.append(keep_mask(torch.Size((3, 1001, 129)), 19661))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(masks[0], masks[1])
    torch.manual_seed(8)
    assert not torch.equal(masks[0], keep_mask(torch.Size((3, 1001, 129)), 19661))


def test_a_mask_written_in_bf16_is_the_bool_mask_converted() -> None:
    torch.manual_seed(7)
    as_bool = keep_mask(torch.Size((3, 1001, 129)), 19661)
    torch.manual_seed(7)
    as_bf16 = keep_mask(torch.Size((3, 1001, 129)), 19661, torch.bfloat16)
    assert as_bool.dtype == torch.bool and as_bf16.dtype == torch.bfloat16
    assert torch.equal(as_bf16, as_bool.to(torch.bfloat16))


def test_off_and_unrepresentable_rates_take_the_plain_paths() -> None:
    x = torch.randn(4, 5)
    assert dropout(x, 0.3, training=False) is x and dropout(x, 0.0, training=True) is x
    for p in (1e-7, 1.0):  # rounds to no or every 2^-16 level: F.dropout's own mask, same seed
        torch.manual_seed(3)
        ours = dropout(x, p, training=True)
        torch.manual_seed(3)
        assert torch.equal(ours, F.dropout(x, p, training=True))
