"""torch.compile: every encoding's forward and backward trace as one graph (``fullgraph=True``: any
graph break, e.g. a position read back to the host, fails), in training and in incremental decoding;
and the compiled training step (``train.compile``) gives the eager losses.

The fullgraph training test uses the ``aot_eager`` backend (dynamo traces the forward, AOTAutograd
the backward, where a host read in a backward formula would also break) and the decoding test
``eager`` (dynamo alone): inductor's code generation would only add minutes of C++ compilation on
the CPU. The compiled-step test uses inductor, as ``train.compile`` does.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.models import TRAINED, tiny_model

from tpe_train.config import load_config
from tpe_train.data.batching import BOS_ID, EOS_ID, Batch, pad
from tpe_train.model.loss import label_smoothed_loss
from tpe_train.model.transformer import Transformer
from tpe_train.parallel.context import ParallelContext
from tpe_train.parallel.engine import Engine
from tpe_train.train.step import train_step

pytestmark = pytest.mark.slow  # every test compiles graphs (seconds each)

VARIANTS = [*TRAINED, "shaw+values"]


def small(variant: str, **kw: object) -> Transformer:
    """A 1+1-layer tiny model (compile time grows with the layers' code, not their number)."""
    kind = "shaw" if variant == "shaw+values" else variant
    model = tiny_model(kind, encoder_layers=1, decoder_layers=1, shaw_values=variant == "shaw+values", **kw)
    for enc in model.modules():
        if getattr(enc, "values", None) is not None:
            torch.nn.init.normal_(enc.values)  # zero at init: make the value term count
    return model


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    src = torch.randint(3, 40, (3, 7))
    src[1, 5:] = 0  # padding
    tgt_out = torch.randint(3, 40, (3, 6))
    tgt_in = torch.cat([torch.full((3, 1), BOS_ID), tgt_out[:, :-1]], dim=1)
    return src, tgt_in, tgt_out


@pytest.mark.parametrize("variant", VARIANTS)
def test_training_forward_and_backward_compile_as_one_graph(variant: str) -> None:
    torch._dynamo.reset()
    model = small(variant)
    model.train()
    reference = copy.deepcopy(model)
    src, tgt_in, tgt_out = batch()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    losses = []
    for m in (compiled, reference):
        loss, _, ntok = label_smoothed_loss(m(src, tgt_in), tgt_out, 0, 0.1)
        (loss / ntok).backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("variant", VARIANTS)
def test_incremental_decoding_compiles_as_one_graph(variant: str) -> None:
    """Decoding steps with flex (its score_mod and block mask; explicit for Shaw's values) compile
    as one graph (two: the first step creates the cache buffers) and equal the explicit full pass."""
    torch._dynamo.reset()
    model = small(variant, attention="flex")
    reference = small(variant, attention="explicit")
    reference.load_state_dict(model.state_dict())
    src, tgt_in, _ = batch()
    decode = torch.compile(model.decode, fullgraph=True, backend="eager", dynamic=True)
    with torch.no_grad():
        memory = reference.encode(src)
        full = reference.decode(tgt_in[:, :4], memory)
        cache = model.new_cache()
        steps = [decode(tgt_in[:, i : i + 1], memory, cache) for i in range(4)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_compiled_training_step_gives_the_eager_losses() -> None:
    """``train.compile``: 20 steps of the regionally compiled model (inductor) against eager, fp32,
    with padding, dropout off, T5 (a learned bias whose gradient flows through the mask path)."""
    cfg = load_config("demo", ["train.clip_norm=1.0", "model.dropout=0"])
    losses = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = small("t5")
        model.train()
        if compiled:
            model.compile_layers()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        ctx = ParallelContext.fake()
        engine = Engine(model, opt, sched, ctx, accumulate=1, clip_norm=1.0, deepspeed=None)
        g = torch.Generator().manual_seed(1)
        losses[compiled] = []
        for _ in range(20):
            rows = [
                torch.randint(4, 40, (int(n),), generator=g).tolist()
                for n in torch.randint(3, 9, (4,), generator=g)
            ]
            tgt = [[*r[::-1], EOS_ID] for r in rows]
            b = Batch(
                ids=torch.arange(4),
                src=pad([[*r, EOS_ID] for r in rows]),
                tgt_in=pad([t[:-1] for t in tgt], prefix=BOS_ID),
                tgt_out=pad(tgt),
            )
            losses[compiled].append(train_step(engine, [b], cfg, ctx, amp_dtype=None).read(ctx)["loss"])
    assert losses[True][-1] < losses[True][0]  # it trains
    for eager, comp in zip(losses[False], losses[True], strict=True):
        assert abs(comp - eager) <= 1e-4 * abs(eager), (losses[False], losses[True])


def test_compiled_layers_stay_compiled_for_every_batch_case() -> None:
    """``compile_layers`` on batches of every case that dynamic shapes specialise (encoder or decoder
    layer, a padding mask or none, a batch or a length of 1, equal source and target lengths): more
    graphs than torch's default recompile limit of 8, and none of the calls falls back to eager
    (dynamo's frame counter: each frame ``ok``). Dynamo alone (``eager`` backend): the limit works
    the same with inductor."""
    from torch._dynamo.utils import counters

    dynamo = torch._dynamo.config
    before = dynamo.recompile_limit
    torch._dynamo.reset()
    counters.clear()
    try:
        dynamo.recompile_limit = 8  # torch's default, which compile_layers raises
        torch.manual_seed(0)
        model = tiny_model("t5", dropout=0.1).train()
        model.compile_layers(backend="eager")
        cases = [(3, 5, 2, True), (3, 5, 2, False), (1, 5, 2, False), (3, 1, 2, False), (3, 5, 1, False),
                 (3, 5, 5, True), (3, 2, 2, False), (1, 1, 1, False), (1, 2, 5, False), (3, 1, 1, False),
                 (3, 5, 1, True), (1, 5, 5, False)]  # fmt: skip
        for rows, src_len, tgt_len, padded in cases:
            src = torch.randint(3, 40, (rows, src_len))
            src[0, -1] = 0 if padded else src[0, -1]
            model(src, torch.randint(3, 40, (rows, tgt_len))).sum().backward()
        assert counters["stats"]["unique_graphs"] > 8
        assert counters["frames"]["total"] == counters["frames"]["ok"], dict(counters["frames"])
    finally:
        dynamo.recompile_limit = before
        torch._dynamo.reset()
