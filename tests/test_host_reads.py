"""Training steps read nothing back to the host between log steps.

On a GPU each read of a device value (``.item()``, ``float()``, ``.tolist()``) makes the host wait for
every kernel queued before it, so the host cannot queue the next step while the GPU runs this one.
A step keeps its figures on the device (``StepResult``), the token count is summed there
(``TokenTally``), and the loop reads them at log and checkpoint steps only. CI has no GPU: under
``FakeTensorMode`` tensors hold no data, so any such read raises; the loop's reads are counted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from support.batches import reversal_batches
from support.models import tiny_model
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from tpe_train.config import load_config
from tpe_train.data.batching import Batch
from tpe_train.parallel.context import ParallelContext
from tpe_train.parallel.engine import Engine
from tpe_train.train import step as step_module
from tpe_train.train.schedule import inverse_sqrt
from tpe_train.train.step import StepResult, TokenTally, train_step


@pytest.mark.parametrize("chunk", [0, 7])
def test_optimizer_steps_read_nothing_back_until_their_figures_are_read(chunk: int) -> None:
    """Three steps of two micro-batches each, as the trainer takes them (fused AdamW, clipping, the
    schedule, the device token tally), with fake tensors: no read. Reading a step's figures is the
    read, and raises there; the same steps with real tensors give finite figures."""
    cfg = load_config("demo", ["train.accumulate=2", f"train.loss_chunk_tokens={chunk}"])
    g = torch.Generator().manual_seed(0)
    host = [reversal_batches(2, g, rows=4, vocab=40, lengths=(3, 9)) for _ in range(3)]
    ctx = ParallelContext.fake()

    def steps() -> tuple[StepResult, TokenTally]:
        torch.manual_seed(0)
        model = tiny_model("t5").train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, inverse_sqrt(4))
        engine = Engine(model, opt, sched, ctx, accumulate=2, clip_norm=1.0, deepspeed=None)
        tally = TokenTally()
        for micro in batches:
            result = train_step(engine, micro, cfg, ctx, amp_dtype=None)
            tally.add(result.tokens)
        return result, tally

    with FakeTensorMode() as mode:
        batches = [[Batch(*(mode.from_tensor(t) for t in vars(b).values())) for b in m] for m in host]
        result, tally = steps()
        with pytest.raises(DataDependentOutputException):
            result.read(ctx)
        with pytest.raises(DataDependentOutputException):
            tally.total()
    batches = host
    result, tally = steps()
    figures = result.read(ctx)
    assert figures["tokens"] == sum(b.target_tokens for b in host[-1])
    assert tally.total() == sum(b.target_tokens for m in host for b in m)
    assert all(torch.isfinite(torch.tensor(v)) for v in figures.values()) and figures["grad_norm"] > 0


def test_the_loop_reads_step_figures_only_at_log_and_checkpoint_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real 7-step run, logging every 3 steps and saving at 5 and 7: step figures are read at steps
    3, 6 and 7, the token tally at those and the saves; the checkpoint holds every step's tokens."""
    from tpe_train.train import loop

    taken: list[int] = []  # target tokens of each step, counted on the host
    reads: list[int] = []  # the step at which a step's figures were read
    tally_reads: list[int] = []  # the step at which the tally read pending device counts

    def counted_step(engine: Engine, micro: list[Batch], *args: Any) -> StepResult:
        taken.append(sum(b.target_tokens for b in micro))
        return train_step(engine, micro, *args)

    real_read, real_total = StepResult.read, TokenTally.total

    def read(self: StepResult, ctx: ParallelContext) -> dict[str, float]:
        reads.append(len(taken))
        return real_read(self, ctx)

    def total(self: TokenTally) -> float:
        if self._pending is not None:
            tally_reads.append(len(taken))
        return real_total(self)

    monkeypatch.setattr(loop, "train_step", counted_step)
    monkeypatch.setattr(step_module.StepResult, "read", read)
    monkeypatch.setattr(step_module.TokenTally, "total", total)
    monkeypatch.setenv("TPE_DATA_CACHE", str(tmp_path / "data"))
    run_dir = tmp_path / "run"
    loop.run(load_config("demo", [
        "model.d_model=32", "model.n_heads=4", "model.ffn_dim=64", "model.encoder_layers=1",
        "model.decoder_layers=1", "data.vocab_size=100", "data.synthetic.train_size=300",
        "data.synthetic.valid_size=20", "data.synthetic.test_size=10", "data.synthetic.probe_size=4",
        "data.synthetic.long_size=4", "data.max_tokens=256", "train.max_steps=7", "train.log_every=3",
        "train.save_every=5", "train.valid_every=100", "train.valid_bleu_size=0", "train.diagnostics_every=0",
        "train.progress=false", "train.threads=1", "eval.at_end=false", f"train.run_dir={run_dir}",
    ]))  # fmt: skip
    assert reads == [3, 6, 7]
    assert tally_reads == [3, 5, 6, 7]  # a save after a log step at 7 finds nothing pending
    trainer = [run_dir / "checkpoints" / f"step-{s:08d}" / "trainer.json" for s in (5, 7)]
    saved = [json.loads(path.read_text()) for path in trainer]
    assert [t["tokens"] for t in saved] == [sum(taken[:5]), sum(taken)] and sum(taken) > 0
