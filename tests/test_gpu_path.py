"""The GPU's attention path, guarded on the CPU (CI has no GPU).

- ``gpu_route``: the CPU calls ``F.scaled_dot_product_attention`` exactly as a GPU does; for every
  encoding under bf16 and fp16 autocast it must receive q, k, v and the mask in the compute dtype,
  last dimension contiguous, in one memory layout whatever the encoding, and give the CPU path's
  outputs.
- A training step of every encoding runs under ``FakeTensorMode``: any host read of data (``.item()``,
  ``float()``, ``int()`` of a tensor) would raise there.
- An op budget per encoding: aten ops of forward + backward counted with a dispatch mode, per layer
  and per model, against ``none``; no host reads, no copies between devices.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support.models import KINDS, tiny_model
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import tpe_train.model.attention as attention
import tpe_train.model.loss as loss_module
from tpe_train.data.batching import Batch
from tpe_train.model.loss import label_smoothed_loss
from tpe_train.train.step import batch_terms, loss_sums

_SDPA = F.scaled_dot_product_attention  # the real one (tests patch the attribute)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    src = torch.randint(3, 40, (3, 7), generator=g)
    src[1, 4:] = 0  # padding
    return src, torch.randint(3, 40, (3, 5), generator=g)


def _layout(t: torch.Tensor) -> tuple[int, ...]:
    """The order of the dimensions in memory, outermost first (ties: by dimension)."""
    return tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), d)))


def _record(
    kind: str, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype = torch.bfloat16
) -> tuple[list[dict[str, Any]], torch.Tensor]:
    """What reaches ``F.scaled_dot_product_attention`` in a training forward + backward of ``kind``
    under ``gpu_route`` and autocast to ``dtype``, and the logits."""
    seen: list[dict[str, Any]] = []

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None, **kw: Any) -> Any:
        seen.append(
            {
                "dtypes": (q.dtype, k.dtype, v.dtype),
                "last_contiguous": all(t.stride(-1) == 1 for t in (q, k, v)),
                "layouts": (_layout(q), _layout(k), _layout(v)),
                "mask": None if attn_mask is None else (attn_mask.dtype, attn_mask.stride(-1) == 1),
            }
        )
        return _SDPA(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    torch.manual_seed(0)
    model = tiny_model(kind)
    model.train()
    src, tgt = batch()
    with attention.gpu_route(), torch.autocast("cpu", dtype=dtype):
        logits = model(src, tgt)
    logits.float().sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads), f"{kind}: a non-finite gradient"
    return seen, logits.detach().float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_gpu_attention_call_gets_compute_dtype_contiguous_inputs_for_every_encoding(
    kind: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 and fp16 autocast (``train.bf16``, ``train.fp16``): q, k, v and a float mask in that dtype
    (a mask built in fp32 and cast, or a bias of -inf in fp16, would show here), finite logits and
    gradients, and the CPU path's logits."""
    seen, logits = _record(kind, monkeypatch, dtype)
    none, _ = _record("none", monkeypatch, dtype) if kind != "none" else (seen, logits)
    assert len(seen) == 6  # 2 encoder self-, 2 decoder self-, 2 cross-attention calls
    for call, ref in zip(seen, none, strict=True):
        assert call["dtypes"] == (dtype,) * 3, call
        assert call["last_contiguous"], call
        assert call["layouts"] == ref["layouts"], f"{kind}: q/k/v layouts differ from none's"
        if call["mask"] is not None:
            mask_dtype, last_contiguous = call["mask"]
            assert mask_dtype in (dtype, torch.bool) and last_contiguous, call
    torch.manual_seed(0)
    cpu = tiny_model(kind)
    cpu.train()
    src, tgt = batch()
    with torch.autocast("cpu", dtype=dtype):
        expected = cpu(src, tgt).float()
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, expected, atol=0.1, rtol=0.05)


class _Cfg:
    class train:  # the attribute path of Config that batch_terms reads
        label_smoothing = 0.1
        loss_chunk_tokens = 0


@pytest.mark.parametrize("kind", [*KINDS, "shaw+values"])
def test_a_training_step_of_every_encoding_runs_under_fake_tensors(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No data-dependent host read in forward, loss or backward: FakeTensorMode has no data, so a
    ``.item()``/``float()``/``int()`` of a tensor raises there (DataDependentOutputException).

    The loss takes the GPU's kernel: the CPU's chunked bf16 kernel compares the incoming gradient
    with its foreseen factor on the host (``torch.equal`` in its backward), harmless where the CPU is
    the only device and never taken on a GPU."""
    monkeypatch.setattr(loss_module, "loss_kernel", lambda dtype, device: loss_module._SmoothedCE)
    src, tgt = batch()
    tgt_in = torch.cat([torch.ones(3, 1, dtype=torch.long), tgt[:, :-1]], 1)
    with FakeTensorMode() as mode:
        torch.manual_seed(0)
        model = tiny_model(kind.split("+")[0], shaw_values=kind == "shaw+values")
        model.train()
        fake = Batch(
            mode.from_tensor(torch.arange(3)),
            mode.from_tensor(src),
            mode.from_tensor(tgt_in),
            mode.from_tensor(tgt),
        )
        loss, nll, ntok = batch_terms(model, fake, _Cfg(), amp_dtype=torch.bfloat16)  # type: ignore[arg-type]
        (loss / ntok).backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None for g in grads[:3])
    assert nll.shape == () and ntok.shape == ()


class _ChunkedCfg:
    class train:
        label_smoothing = 0.1
        loss_chunk_tokens = 7  # 3 x 5 target positions: chunks of 7, 7 and 1


@pytest.mark.parametrize("kind", ["rope", "t5"])
def test_a_training_step_with_the_loss_in_chunks_runs_under_fake_tensors(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``train.loss_chunk_tokens``: the chunks and their recomputation in the backward read nothing
    back to the host either (the GPU's loss kernel, as above)."""
    monkeypatch.setattr(loss_module, "loss_kernel", lambda dtype, device: loss_module._SmoothedCE)
    src, tgt = batch()
    tgt_in = torch.cat([torch.ones(3, 1, dtype=torch.long), tgt[:, :-1]], 1)
    with FakeTensorMode() as mode:
        torch.manual_seed(0)
        model = tiny_model(kind).train()
        ids, fsrc, fin, fout = (mode.from_tensor(t) for t in (torch.arange(3), src, tgt_in, tgt))
        fake = Batch(ids, fsrc, fin, fout)
        loss, nll, ntok = batch_terms(model, fake, _ChunkedCfg(), amp_dtype=torch.bfloat16)  # type: ignore[arg-type]
        (loss / ntok).backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None for g in grads) and model.embed.weight.grad is not None
    assert nll.shape == () and ntok.shape == ()


def test_a_validation_pass_reads_nothing_back_per_batch() -> None:
    """``loss_sums`` (the validation pass) adds the batches' nll and token counts on the device: under
    FakeTensorMode a per-batch ``float()``/``int()`` would raise; the real sums equal the per-batch
    host sums."""
    model = tiny_model("t5")
    batches = []
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        src, tgt = (
            torch.randint(3, 40, (3, 6 + seed), generator=g),
            torch.randint(3, 40, (3, 4 + seed), generator=g),
        )
        tgt[seed % 3, 2:] = 0  # padding
        tgt_in = torch.cat([torch.ones(3, 1, dtype=torch.long), tgt[:, :-1]], 1)
        batches.append(Batch(torch.arange(3), src, tgt_in, tgt))
    with FakeTensorMode() as mode:
        fake = [Batch(*(mode.from_tensor(t) for t in (b.ids, b.src, b.tgt_in, b.tgt_out))) for b in batches]
        nll, ntok = loss_sums(tiny_model("t5"), iter(fake), _Cfg(), amp_dtype=None)  # type: ignore[arg-type]
    assert nll.shape == () and ntok.shape == ()
    with torch.no_grad():
        nll, ntok = loss_sums(model, iter(batches), _Cfg(), amp_dtype=None)  # type: ignore[arg-type]
        each = [batch_terms(model, b, _Cfg(), amp_dtype=None) for b in batches]  # type: ignore[arg-type]
    assert nll.dtype == torch.float64
    assert float(nll) == pytest.approx(sum(float(e[1]) for e in each), rel=1e-12)
    assert int(ntok) == sum(int(e[2]) for e in each) > 0


class _Count(TorchDispatchMode):
    """aten ops by name; host reads; copies that change device."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.device_copies = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        self.ops[name] += 1
        if name in ("aten._to_copy", "aten.copy_", "aten.copy"):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            target = kwargs.get("device")
            devices = {t.device for t in tensors} | ({torch.device(target)} if target is not None else set())
            self.device_copies += len(devices) > 1
        return func(*args, **kwargs)


def _ops(kind: str, layers: int) -> _Count:
    torch.manual_seed(0)
    model = tiny_model(kind, encoder_layers=layers, decoder_layers=layers)
    model.train()
    src, tgt = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16), _Count() as count:
        logits = model(src, tgt)
        loss, _, ntok = label_smoothed_loss(logits.float(), tgt, 0, 0.1)
        (loss / ntok).backward()
    return count


#: extra aten ops (forward + backward, bf16 autocast, CPU path) per layer (one encoder + one decoder
#: layer) and per model (once per stack and batch), against ``none``; measured 2026-12-04, torch 2.13:
#: before: rope 118 per layer (angles in float64 for q and for k in every call, 20 casts), shaw 59,
#: t5 -2, alibi -5, sinusoidal 0 (+32 per model), learned 0 (+12); after: rope 72 per layer (+44 per
#: model: the cos/sin tables once per stack), shaw 59 (its per-layer table: q.R^T, gather and their
#: backward), t5 -2 (+66), alibi -5 (+28), sinusoidal 0 (+32), learned 0 (+12). ``none`` itself: 1050
#: ops for 2 + 2 layers. 2026-12-05: rope 46 per layer (+44 per model), its half swap one ``roll`` of
#: a product instead of two slices and a ``cat`` of the input (and their two ``slice_backward``).
#: 2026-12-06: kerple_log -2 (+83 per model), kerple_power -2 (+101), sandwich -5 (+44), fire -2 (+237:
#: its MLP over the (Lq, Lk) distances and the backward, once per stack), xpos 46 (+94: RoPE's tables
#: for queries and keys apart, each with its decay), cope 232 (+0: gates from q.k^T, their cumulative
#: sum, four gathers and q.e per layer, forward and backward).
BUDGET = {
    "none": (0, 0),
    "sinusoidal": (0, 40),
    "learned": (0, 16),
    "shaw": (64, 8),
    "t5": (2, 72),
    "alibi": (2, 32),
    "rope": (48, 48),
    "kerple_log": (2, 88),
    "kerple_power": (2, 106),
    "sandwich": (2, 48),
    "fire": (2, 244),
    "xpos": (48, 100),
    "cope": (240, 8),
}


def test_the_budget_names_every_encoding() -> None:
    assert sorted(BUDGET) == sorted(KINDS)


def test_extra_ops_per_layer_of_every_encoding_stay_within_budget() -> None:
    """Per layer: (ops with 2 + 2 layers) - (ops with 1 + 1 layers), minus the same for ``none``; per
    model: the rest. A term rebuilt in every layer (a table, a cast, a Python loop over heads) shows
    as ops per layer; host reads (``_local_scalar_dense``) and copies between devices must be 0."""
    base = {n: sum(_ops("none", n).ops.values()) for n in (1, 2)}
    report = {}
    for kind in KINDS:
        one, two = _ops(kind, 1), _ops(kind, 2)
        per_layer = (sum(two.ops.values()) - sum(one.ops.values())) - (base[2] - base[1])
        per_model = sum(one.ops.values()) - base[1] - per_layer
        report[kind] = (per_layer, per_model)
        assert two.ops["aten._local_scalar_dense"] == 0, f"{kind}: a host read in forward/backward"
        assert two.device_copies == 0, f"{kind}: a copy between devices"
    over = {k: (v, BUDGET[k]) for k, v in report.items() if v[0] > BUDGET[k][0] or v[1] > BUDGET[k][1]}
    assert not over, f"over budget (measured (per layer, per model), budget): {over}"


@pytest.mark.slow
def test_shaws_score_mod_compiles_with_dynamic_shapes_on_the_cpu() -> None:
    """Compiled FlexAttention (``dynamic=True``, no block mask, forward only: the CPU has no flex
    backward) with Shaw's score_mod at several batches and lengths, decoding shapes included, equals
    the dense bias. Its earlier form failed to lower here (``'Mul' object has no attribute
    'get_name'``; on the H200: ``'ShapeAsConstantBuffer' object has no attribute 'dtype'``). torch
    2.13's CPU template fails to build the first, static-shape compile of it (a C++ error:
    ``cur_qSplitSize`` not declared), so that one call may raise that; from the second shape on, the
    dynamic kernel compiles and serves every shape. T5's and ALiBi's score_mods compile at their first
    call (measured, not repeated here: each compile takes seconds)."""
    from torch._inductor.exc import InductorError
    from torch.nn.attention.flex_attention import flex_attention

    from tpe_train.positions import PositionArgs, build_position

    enc = build_position("shaw", PositionArgs(d_model=64, n_heads=4, causal=True, shaw_clip=3))
    compiled = torch.compile(flex_attention, dynamic=True)
    shapes = [
        (2, 16, 16, 0),
        (3, 24, 24, 0),
        (3, 1, 9, 8),
        (5, 40, 40, 0),
        (3, 7, 11, 0),
    ]  # B, Lq, Lk, offset
    for i, (b, lq, lk, offset) in enumerate(shapes):
        q = torch.randn(b, 4, lq, 16)
        k, v = torch.randn(b, 4, lk, 16), torch.randn(b, 4, lk, 16)
        k_pos = torch.arange(lk)
        q_pos = k_pos if lq == lk else torch.arange(offset, offset + lq)
        with torch.no_grad():
            try:
                out = compiled(q, k, v, score_mod=enc.score_mod(q, q_pos, k_pos))
            except InductorError as e:
                assert i == 0 and "C++ compile error" in str(e), e
                continue
            dense = torch.softmax(q @ k.transpose(-1, -2) / 4 + enc.attn_bias(q, q_pos, k_pos), -1) @ v
        torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)
