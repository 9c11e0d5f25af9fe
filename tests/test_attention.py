"""Attention backends: flex (score_mod + BlockMask) equals explicit for every encoding, in the full
pass and in incremental decoding; how ``auto`` chooses; the errors of impossible choices.

On the CPU ``flex`` runs torch's unfused FlexAttention (the same score_mod and BlockMask the fused GPU
kernel takes); benchmarks/gpu/attention.py checks the fused kernel, gradients included, on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from support.models import KINDS, tiny_model

import tpe_train.model.attention as attention
from tpe_train.model.attention import choose_backend
from tpe_train.model.generate import beam_search
from tpe_train.model.transformer import Transformer
from tpe_train.positions import PositionArgs, PositionEncoding, build_position

VARIANTS = [*KINDS, "shaw+values"]


def pair(variant: str, **kw: object) -> tuple[Transformer, Transformer]:
    """The same weights behind ``flex`` and behind ``explicit``."""
    kind = "shaw" if variant == "shaw+values" else variant
    models = []
    for backend in ("flex", "explicit"):
        torch.manual_seed(0)
        model = tiny_model(kind, attention=backend, shaw_values=variant == "shaw+values", **kw)
        for enc in model.modules():
            if getattr(enc, "values", None) is not None:
                torch.nn.init.normal_(enc.values)  # zero at init: make the value term count
        models.append(model)
    return models[0], models[1]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.randint(3, 40, (3, 7))
    src[1, 4:] = 0  # padding
    src[2, 6:] = 0
    return src, torch.randint(3, 40, (3, 5))


@pytest.mark.parametrize("variant", VARIANTS)
def test_flex_equals_explicit_in_the_full_pass_and_in_incremental_decoding(variant: str) -> None:
    flex, explicit = pair(variant, encoder_layers=1, decoder_layers=1)
    src, tgt = batch()
    with torch.no_grad():
        memory = explicit.encode(src)
        reference = explicit.decode(tgt, memory)  # causal self-attention, padded cross-attention
        flex_memory = flex.encode(src)  # bidirectional self-attention over padded keys
        torch.testing.assert_close(flex_memory.states, memory.states, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(flex.decode(tgt, flex_memory), reference, atol=1e-5, rtol=1e-5)
        cache = flex.new_cache()  # a prefix of 2, then one token at a time (positions with offsets)
        steps = [flex.decode(tgt[:, :2], flex_memory, cache)]
        steps += [flex.decode(tgt[:, i : i + 1], flex_memory, cache) for i in range(2, 5)]
    torch.testing.assert_close(torch.cat(steps, dim=1), reference, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["t5", "shaw"])
def test_flex_beam_search_equals_explicit(kind: str) -> None:
    """Beam search: the beams of a sentence are the queries of one memory (a (B, H, K, hd) block)."""
    flex, explicit = pair(kind)
    src, _ = batch()
    assert beam_search(flex, src, beam=3, max_len_b=5) == beam_search(explicit, src, beam=3, max_len_b=5)


def test_one_block_mask_per_batch_and_attention_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Padding and causality: one BlockMask for encoder self-, decoder self- and cross-attention each,
    shared by every layer (2 + 2 layers here), not one per layer or head."""
    built: list[tuple[int, ...]] = []
    real = attention.create_block_mask

    def counting(*args: object, **kw: object) -> object:
        built.append(tuple(int(a) for a in args[1:5] if isinstance(a, int)))  # (B, Q_LEN, KV_LEN)
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(attention, "create_block_mask", counting)
    flex, explicit = pair("t5")
    src, tgt = batch()
    with torch.no_grad():
        out = flex(src, tgt)
    assert sorted(built) == sorted([(3, 7, 7), (3, 5, 5), (3, 5, 7)])
    torch.testing.assert_close(out, explicit(src, tgt), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["t5", "alibi"])
def test_flex_score_mod_of_a_tensor_parallel_rank_uses_its_global_heads(kind: str) -> None:
    """A rank that keeps heads [2, 3] gives, through flex, the full encoding's heads 2 and 3."""
    full = build_position(kind, PositionArgs(d_model=32, n_heads=4, causal=False))
    part = build_position(kind, PositionArgs(d_model=32, n_heads=4, causal=False))
    part.load_state_dict(full.state_dict())
    part.keep_heads([2, 3])
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    pos = torch.arange(6) + 11  # positions with an offset
    with torch.no_grad():
        whole = attention._flex(q, k, v, full.score_mod(q, pos, pos), None)
        mine = attention._flex(q[:, 2:], k[:, 2:], v[:, 2:], part.score_mod(q[:, 2:], pos, pos), None)
    torch.testing.assert_close(mine, whole[:, 2:], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", ["t5", "alibi", "shaw"])
def test_score_mods_equal_the_dense_bias(kind: str) -> None:
    """Each encoding's own score_mod (a lookup), the base class's score_mod derived from attn_bias,
    and the dense bias added to the scores give the same attention."""
    enc = build_position(kind, PositionArgs(d_model=32, n_heads=4, causal=True, shaw_clip=2))
    q, k, v = (torch.randn(2, 4, 5, 8) for _ in range(3))
    q_pos, k_pos = torch.arange(3, 8), torch.arange(0, 5) + 3
    with torch.no_grad():
        dense = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5 + enc.attn_bias(q, q_pos, k_pos), dim=-1) @ v
        own = attention._flex(q, k, v, enc.score_mod(q, q_pos, k_pos), None)
        derived = attention._flex(q, k, v, PositionEncoding.score_mod(enc, q, q_pos, k_pos), None)
    torch.testing.assert_close(own, dense, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(derived, dense, atol=1e-6, rtol=1e-6)


def test_auto_takes_sdpa_and_explicit_where_the_weights_are_needed() -> None:
    """The choice depends on the request and the encoding only (no device, grad mode or dropout):
    flex measured slower than sdpa for every encoding (docs/attention.md)."""
    t5 = build_position("t5", PositionArgs(d_model=32, n_heads=4, causal=False))
    rope = build_position("rope", PositionArgs(d_model=32, n_heads=4, causal=False))
    shaw_v = build_position("shaw", PositionArgs(d_model=32, n_heads=4, causal=False, shaw_values=True))
    alibi = build_position("alibi", PositionArgs(d_model=32, n_heads=4, causal=False))
    assert choose_backend("auto", t5) == "sdpa"
    assert choose_backend("auto", alibi) == "sdpa"
    assert choose_backend("flex", alibi) == "flex"  # asked for: kept
    assert choose_backend("auto", rope) == "sdpa"
    assert choose_backend("flex", shaw_v) == "explicit"  # needs the weights
    assert choose_backend("explicit", rope) == "explicit"


def test_flex_training_on_the_cpu_is_a_clear_error() -> None:
    model = tiny_model("t5", attention="flex")
    model.train()
    src, tgt = batch()
    with pytest.raises(RuntimeError, match=r"cannot train on the CPU.*model.attention=auto or sdpa"):
        model(src, tgt)


def test_a_model_built_without_a_config_refuses_what_the_config_refuses() -> None:
    """The config's rules, from the same functions, where a model is built directly (tests, tools)."""
    with pytest.raises(ValueError, match="flex has no dropout on the attention weights"):
        tiny_model("t5", attention="flex", attention_dropout=0.1)
    with pytest.raises(ValueError, match=r"rope needs an even head dimension.*= 3"):
        build_position("rope", PositionArgs(d_model=12, n_heads=4, causal=False))
    tiny_model("t5", attention="sdpa", attention_dropout=0.1)  # dropout with another backend is fine


@pytest.mark.parametrize("backend", ["sdpa", "explicit"])
@pytest.mark.parametrize("kind", ["t5", "alibi"])
def test_a_shared_bias_is_folded_once_per_stack_with_the_same_outputs_and_gradients(
    kind: str, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """T5 and ALiBi (``shared_bias``): the dense mask is built by the first layer of a stack and reused
    by the others (3 + 3 layers: one bias per stack, not one per layer), in training and in incremental
    decoding, with the outputs and every gradient (the T5 table's included) of a per-layer build."""
    models = []
    for share in (True, False):
        torch.manual_seed(0)
        model = tiny_model(kind, attention=backend, encoder_layers=3, decoder_layers=3)
        for enc in model.modules():
            if isinstance(enc, PositionEncoding):
                enc.shared_bias = share  # type: ignore[misc]
        models.append(model)
    calls = {"n": 0}
    real = type(models[0].encoder.pos(0)).attn_bias

    def counting(self: PositionEncoding, *args: torch.Tensor) -> torch.Tensor | None:
        calls["n"] += 1
        return real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(type(models[0].encoder.pos(0)), "attn_bias", counting)
    src, tgt = batch()
    outputs, grads, counts = [], [], []
    for model in models:
        calls["n"] = 0
        logits = model(src, tgt)
        counts.append(calls["n"])
        logits.square().sum().backward()
        outputs.append(logits)
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert counts == [2, 6]  # encoder + decoder stack, against 3 + 3 layers
    torch.testing.assert_close(outputs[0], outputs[1], atol=0, rtol=0)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5, msg=name)
    if kind == "t5":
        assert any("table" in n for n in grads[0])  # the position parameters were compared
    with torch.no_grad():  # incremental decoding: one bias per stack and step, the same outputs
        decoded = []
        for model in models:
            memory, cache = model.encode(src), model.new_cache()
            calls["n"] = 0
            decoded.append(torch.cat([model.decode(tgt[:, i : i + 1], memory, cache) for i in range(5)], 1))
            counts.append(calls["n"])
    assert counts[2:] == [5, 15]
    torch.testing.assert_close(decoded[0], decoded[1], atol=1e-6, rtol=1e-5)


def _reference_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> torch.Tensor:
    """SDPA's math backend in fp64: the formula every CPU path of ``_sdpa`` must give."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mask = kw.pop("mask")
    if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool:
        mask = mask.double()
    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(
            q.double(), k.double(), v.double(), attn_mask=mask, **kw
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masking", ["bool", "float", "causal"])
def test_the_cpu_sdpa_paths_equal_sdpa_forward_and_backward(
    dtype: torch.dtype, masking: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``_sdpa`` on the CPU: bf16, and any float mask (T5/ALiBi, padding + causality), take the formula
    written out instead of SDPA's math backend (which widens bf16 q, k, v to fp32 and back); fp32
    with a boolean mask keeps SDPA. Outputs and the gradients of q, k, v equal SDPA's in fp64 within
    fp32 rounding (fp32), and within bf16 rounding of the scores and outputs (bf16)."""
    torch.manual_seed(0)
    b, h, lq, lk, hd = 3, 2, 7, 7, 8
    qkv = [torch.randn(b, h, n, hd) for n in (lq, lk, lk)]
    keep = torch.ones(b, 1, 1, lk, dtype=torch.bool)
    keep[0, ..., 5:] = False
    mask: torch.Tensor | None = {
        "bool": keep,
        "float": torch.randn(1, h, lq, lk).masked_fill(~keep, float("-inf")),
        "causal": None,
    }[masking]
    causal = masking == "causal"
    calls = {"sdpa": 0}
    real = torch.nn.functional.scaled_dot_product_attention

    def counting(*args: object, **kw: object) -> torch.Tensor:
        calls["sdpa"] += 1
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", counting)
    ours = [t.to(dtype, copy=True).requires_grad_() for t in qkv]
    given = mask.to(dtype) if mask is not None and masking == "float" else mask
    out = attention._sdpa(*ours, given, 0.0, causal)
    assert calls["sdpa"] == (1 if dtype == torch.float32 and masking != "float" else 0)
    refs = [t.double().requires_grad_() for t in qkv]
    expected = _reference_sdpa(*refs, mask=mask, is_causal=causal)
    weights = torch.randn(expected.shape, dtype=torch.float64)
    (out.double() * weights).sum().backward()
    (expected * weights).sum().backward()
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 6e-2, "rtol": 3e-2}
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, **tol)  # type: ignore[arg-type]
    for name, mine, theirs in zip("qkv", ours, refs, strict=True):
        assert mine.grad is not None and theirs.grad is not None
        torch.testing.assert_close(mine.grad.double(), theirs.grad, **tol, msg=name)  # type: ignore[arg-type]


def test_the_written_out_cpu_attention_drops_weights_as_dropout_does() -> None:
    """With dropout the written-out path drops attention weights with the model's CPU dropout: the
    same generator state gives the same output as the formula with ``dropout`` applied by hand."""
    from tpe_train.model.dropout import dropout

    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 2, 6, 4, dtype=torch.bfloat16) for _ in range(3))
    state = torch.get_rng_state()
    out = attention._sdpa(q, k, v, None, 0.25)
    torch.set_rng_state(state)
    weights = torch.softmax(torch.matmul(q, k.transpose(-1, -2)).mul_(0.5), -1, dtype=torch.float32)
    expected = torch.matmul(dropout(weights.to(q.dtype), 0.25, True), v)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    assert not torch.equal(out, attention._sdpa(q, k, v, None, 0.0))
