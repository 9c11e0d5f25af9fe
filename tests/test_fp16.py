"""fp16 without DeepSpeed (``train.fp16`` on one process or under DDP): fp16 autocast, torch's dynamic
loss scaling, the overflow check and the skipped update on the device inside the fused AdamW step.

The CPU runs the same code as a GPU (torch's loss scaler and fused AdamW exist on both): an overflow
skips the update and halves the scale, the steps read nothing back, fp16 training follows fp32, and
the scale survives a checkpoint. Exact resume of an fp16 run is in ``test_checkpoints.py``."""

from __future__ import annotations

import pytest
import torch
from support.batches import reversal_batches
from support.models import tiny_model
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

import tpe_train.model.loss as loss_module
from tpe_train.config import load_config
from tpe_train.data.batching import Batch
from tpe_train.parallel.context import ParallelContext
from tpe_train.parallel.engine import Engine
from tpe_train.train.schedule import inverse_sqrt
from tpe_train.train.step import StepResult, train_step

CTX = ParallelContext.fake()
CFG = load_config("demo", ["model.dropout=0"])


def engine(loss_scale: float | None, window: int = 1000) -> Engine:
    torch.manual_seed(0)
    model = tiny_model("t5").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, inverse_sqrt(4))
    return Engine(
        model,
        opt,
        sched,
        CTX,
        accumulate=1,
        clip_norm=1.0,
        deepspeed=None,
        loss_scale=loss_scale,
        scale_window=window,
    )


def batches(n: int) -> list[Batch]:
    return reversal_batches(n, torch.Generator().manual_seed(0), rows=4, vocab=40, lengths=(3, 9))


def test_an_overflow_skips_the_update_and_halves_the_scale() -> None:
    """A scale of 2**40 overflows fp16 gradients: the step leaves every weight and Adam's step count as
    they were and halves the scale, until the scale fits; then the weights move."""
    eng = engine(loss_scale=2.0**40)
    before = {k: v.clone() for k, v in eng.module.state_dict().items()}
    result = train_step(eng, batches(1), CFG, CTX, amp_dtype=torch.float16)
    assert not torch.isfinite(torch.as_tensor(result.grad_norm))
    assert all(torch.equal(v, before[k]) for k, v in eng.module.state_dict().items())  # bitwise
    assert all(int(s["step"]) == 0 for s in eng.optimizer.state.values())
    assert eng.loss_scale_state() == {"cur_scale": 2.0**39, "growth_tracker": 0.0}
    figures = [train_step(eng, [b], CFG, CTX, amp_dtype=torch.float16).read(CTX) for b in batches(40)]
    state = eng.loss_scale_state()
    assert state is not None and state["cur_scale"] < 2.0**39
    skipped = sum(not torch.isfinite(torch.tensor(f["grad_norm"])) for f in figures)
    assert 0 < skipped < 40 and int(next(iter(eng.optimizer.state.values()))["step"]) == 40 - skipped
    assert any(not torch.equal(v, before[k]) for k, v in eng.module.state_dict().items())


def test_the_scale_doubles_after_a_window_without_overflow() -> None:
    eng = engine(loss_scale=2.0**8, window=3)
    for b in batches(7):
        train_step(eng, [b], CFG, CTX, amp_dtype=torch.float16)
    assert eng.loss_scale_state() == {"cur_scale": 2.0**10, "growth_tracker": 1.0}  # doubled at 3 and 6


def test_fp16_training_follows_fp32() -> None:
    """20 steps: the fp16 losses (autocast, scaled gradients, fused AdamW) follow fp32's within 2%, and
    so do the gradient norms, reported unscaled (Adam would hide a gradient left scaled: its update
    does not change when the gradient is multiplied by a constant)."""
    figures = {}
    for dtype, scale in ((None, None), (torch.float16, 2.0**12)):
        eng = engine(loss_scale=scale)
        figures[dtype] = [train_step(eng, [b], CFG, CTX, amp_dtype=dtype).read(CTX) for b in batches(20)]
    fp32, fp16 = figures[None], figures[torch.float16]
    assert fp32[-1]["loss"] < 0.9 * fp32[0]["loss"]  # it trains
    for key in ("loss", "grad_norm"):
        got = [f[key] for f in fp16]
        assert got == pytest.approx([f[key] for f in fp32], rel=0.02), key


def test_fp16_steps_read_nothing_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scaled backward, the unscale and overflow check, clipping and the skipped or taken update,
    with fake tensors: any read of a device value raises, and none happens until the figures are read.
    The loss takes the GPU's kernel (the CPU's lower-precision kernel compares its incoming gradient on
    the host, see ``test_gpu_path.py``)."""
    monkeypatch.setattr(loss_module, "loss_kernel", lambda dtype, device: loss_module._SmoothedCE)
    host = batches(3)
    with FakeTensorMode() as mode:
        fake = [Batch(*(mode.from_tensor(t) for t in vars(b).values())) for b in host]
        eng = engine(loss_scale=2.0**16)
        result: StepResult | None = None
        for b in fake:
            result = train_step(eng, [b], CFG, CTX, amp_dtype=torch.float16)
        assert result is not None
        with pytest.raises(DataDependentOutputException):
            result.read(CTX)


def test_the_loss_scale_is_restored_from_a_checkpoint_state() -> None:
    """What a checkpoint keeps of the scale (DeepSpeed's keys, torch's growth tracker) restores it."""
    eng = engine(loss_scale=2.0**8, window=3)
    for b in batches(4):
        train_step(eng, [b], CFG, CTX, amp_dtype=torch.float16)
    state = eng.loss_scale_state()
    assert state == {"cur_scale": 2.0**9, "growth_tracker": 1.0}
    other = engine(loss_scale=2.0**16, window=3)
    other.load_loss_scale_state(state)
    assert other.loss_scale_state() == state
    other.load_loss_scale_state({"cur_scale": 4096.0, "cur_iter": 7.0})  # saved by DeepSpeed's fp16
    assert other.loss_scale_state() == {"cur_scale": 4096.0, "growth_tracker": 0.0}
    assert engine(loss_scale=None).loss_scale_state() is None


@pytest.mark.parametrize(
    ("overrides", "device", "capability", "warned"),
    [
        (["train.bf16=true"], "cuda:0", (7, 0), True),  # V100
        (["train.bf16=true"], "cuda:0", (7, 5), True),  # T4
        (["train.bf16=true"], "cuda:0", (9, 0), False),  # H100/H200
        (["train.fp16=true"], "cuda:0", (7, 0), False),
        (["train.bf16=true"], "cpu", (7, 0), False),
    ],
)
def test_bf16_on_a_gpu_without_bf16_units_is_warned_of(
    monkeypatch: pytest.MonkeyPatch,
    overrides: list[str],
    device: str,
    capability: tuple[int, int],
    warned: bool,
) -> None:
    """The GPU's capability is the one thing a CPU cannot have: torch's query is replaced here."""
    from tpe_train.train.precision import precision_warning

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-32GB")
    warning = precision_warning(load_config("demo", overrides), torch.device(device))
    assert (warning is not None) == warned
    if warned:
        assert warning is not None and f"compute capability {capability[0]}.{capability[1]}" in warning
        assert "train.fp16=true" in warning
