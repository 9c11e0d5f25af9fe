"""Model contracts: permutation equivariance without positions, incremental decoding equals the
full pass, beam 1 equals greedy, a tiny model overfits a tiny batch."""

from __future__ import annotations

import pytest
import torch
from support.models import KINDS, TRAINED, tiny_model

from tpe_train.model.generate import beam_search, greedy
from tpe_train.model.loss import _ChunkedSmoothedCE, _SmoothedCE, label_smoothed_loss, loss_kernel
from tpe_train.positions.contextual import ContextualPosition


def test_none_encoder_is_permutation_equivariant() -> None:
    model = tiny_model("none")
    src = torch.randint(3, 40, (2, 9))
    perm = torch.randperm(9)
    out = model.encode(src).states
    out_perm = model.encode(src[:, perm]).states
    torch.testing.assert_close(out_perm, out[:, perm], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "none"])
def test_positions_break_permutation_equivariance(kind: str) -> None:
    model = tiny_model(kind)
    for enc in model.modules():
        if isinstance(enc, ContextualPosition):  # CoPE's table starts at zero, as in the paper
            torch.nn.init.normal_(enc.table)
    src = torch.randint(3, 40, (1, 9))
    # Swap two tokens. (Not a reversal: the symmetric ALiBi encoder is blind to reversal, which
    # keeps every |i - j|.)
    perm = torch.tensor([3, 1, 2, 0, 4, 5, 6, 7, 8])
    out = model.encode(src).states
    assert not torch.allclose(model.encode(src[:, perm]).states, out[:, perm], atol=1e-4)


@pytest.mark.parametrize("kind", [*KINDS, "shaw+values"])
@pytest.mark.parametrize("pre_norm", [False, True])
def test_incremental_decoding_equals_full_pass(kind: str, pre_norm: bool) -> None:
    if kind == "shaw+values":
        model = tiny_model("shaw", shaw_values=True, pre_norm=pre_norm)
        torch.nn.init.normal_(model.decoder.positions[0].values)  # zero at init
    else:
        model = tiny_model(kind, pre_norm=pre_norm)
    src = torch.randint(3, 40, (3, 7))
    src[1, 5:] = 0  # padding
    tgt = torch.randint(3, 40, (3, 6))
    memory = model.encode(src)
    full = model.decode(tgt, memory)
    cache = model.new_cache()
    steps = [model.decode(tgt[:, i : i + 1], memory, cache) for i in range(tgt.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    # also in chunks (a prefix, then one token at a time)
    cache = model.new_cache()
    chunk = [model.decode(tgt[:, :3], memory, cache)] + [
        model.decode(tgt[:, i : i + 1], memory, cache) for i in range(3, 6)
    ]
    torch.testing.assert_close(torch.cat(chunk, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_beam_one_equals_greedy(kind: str) -> None:
    model = tiny_model(kind)
    src = torch.randint(3, 40, (4, 6))
    src[2, 4:] = 0
    assert beam_search(model, src, beam=1, max_len_b=10) == greedy(model, src, max_len_b=10)


def test_beam_search_respects_length_limit_and_finds_better_scores() -> None:
    model = tiny_model("sinusoidal")
    src = torch.randint(3, 40, (3, 5))
    hyps = beam_search(model, src, beam=4, max_len_a=0.0, max_len_b=4)
    assert all(len(h) <= 3 for h in hyps)  # 4 positions including EOS


def test_learned_positions_cap_decoding_length() -> None:
    model = tiny_model("learned")  # 64 positions
    src = torch.randint(3, 40, (1, 10))
    hyp = greedy(model, src, max_len_a=10.0, max_len_b=500)[0]
    assert len(hyp) < 64


def test_label_smoothed_loss_matches_torch() -> None:
    logits = torch.randn(2, 5, 11)
    target = torch.randint(1, 11, (2, 5))
    target[0, 3:] = 0
    loss, nll, ntok = label_smoothed_loss(logits, target, pad_id=0, epsilon=0.1)
    ref = torch.nn.functional.cross_entropy(
        logits.view(-1, 11), target.view(-1), ignore_index=0, label_smoothing=0.1, reduction="sum"
    )
    torch.testing.assert_close(loss, ref)
    assert int(ntok) == 8
    ref_nll = torch.nn.functional.cross_entropy(
        logits.view(-1, 11), target.view(-1), ignore_index=0, reduction="sum"
    )
    torch.testing.assert_close(nll, ref_nll)


@pytest.mark.parametrize("kind", TRAINED)
def test_tiny_model_overfits_a_tiny_batch(kind: str) -> None:
    model = tiny_model(kind)
    model.train()
    src = torch.randint(3, 40, (4, 6))
    tgt_out = torch.cat([src.flip(1), torch.full((4, 1), 2)], dim=1)  # reversed source + EOS
    tgt_in = torch.cat([torch.full((4, 1), 1), tgt_out[:, :-1]], dim=1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(150):
        loss, _, ntok = label_smoothed_loss(model(src, tgt_in), tgt_out, 0, 0.0)
        opt.zero_grad()
        (loss / ntok).backward()
        opt.step()
    assert float(loss.detach() / ntok) < 0.05


@pytest.mark.parametrize("kind", [*TRAINED, "shaw+values"])
def test_bf16_autocast_trains_every_encoding(kind: str) -> None:
    model = tiny_model("shaw", shaw_values=True) if kind == "shaw+values" else tiny_model(kind)
    model.train()
    src = torch.randint(3, 40, (4, 6))
    src[1, 4:] = 0
    tgt_out = torch.cat([src.flip(1), torch.full((4, 1), 2)], dim=1)
    tgt_in = torch.cat([torch.full((4, 1), 1), tgt_out[:, :-1]], dim=1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(src, tgt_in)
        assert logits.dtype == torch.bfloat16
        loss, _, ntok = label_smoothed_loss(logits, tgt_out, 0, 0.1)
        opt.zero_grad()
        (loss / ntok).backward()
        opt.step()
        losses.append(float(loss.detach() / ntok))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [3, 11])  # 21 rows: one chunk of the bf16 kernel; 77 rows: three
def test_label_smoothed_loss_gradient_matches_autograd_reference(dtype: torch.dtype, batch: int) -> None:
    logits = torch.randn(batch, 7, 13, dtype=dtype, requires_grad=True)
    target = torch.randint(1, 13, (batch, 7))
    target[1, 4:] = 0
    loss, _, _ = label_smoothed_loss(logits, target, pad_id=0, epsilon=0.1)
    (loss * 0.5).backward()
    ours = logits.grad
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(
        ref_logits.float().view(-1, 13), target.view(-1), ignore_index=0, label_smoothing=0.1, reduction="sum"
    )
    torch.testing.assert_close(loss, ref, atol=1e-3, rtol=1e-5)
    (ref * 0.5).backward()
    assert ours is not None and ours.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours, ref_logits.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(loss, ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("hint", [0.5, 0.25, 1.0])
def test_the_gradient_scale_hint_changes_no_gradient(hint: float) -> None:
    """The bf16 kernel folds ``grad_scale`` into the gradient it computes in the forward; whether the
    backward's factor is the hint (0.5: handed on as it is) or not (another factor: rescaled), the
    gradient is the reference's, and the loss is the unscaled sum either way."""
    logits = torch.randn(11, 7, 13, dtype=torch.bfloat16, requires_grad=True)  # 77 rows: three chunks
    target = torch.randint(1, 13, (11, 7))
    target[1, 4:] = 0
    loss, _, _ = label_smoothed_loss(logits, target, pad_id=0, epsilon=0.1, grad_scale=hint)
    (loss * 0.5).backward()
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(
        ref_logits.float().view(-1, 13), target.view(-1), ignore_index=0, label_smoothing=0.1, reduction="sum"
    )
    (ref * 0.5).backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(loss, ref.detach(), atol=1e-3, rtol=1e-5)


def test_bf16_logits_take_chunks_on_the_cpu_only() -> None:
    assert loss_kernel(torch.bfloat16, "cpu") is _ChunkedSmoothedCE
    assert loss_kernel(torch.float32, "cpu") is _SmoothedCE
    # on a GPU, chunks are many small kernel launches (4x slower steps were measured on an H200)
    assert (
        loss_kernel(torch.bfloat16, "cuda") is _SmoothedCE
        and loss_kernel(torch.float32, "cuda") is _SmoothedCE
    )


@pytest.mark.parametrize("kernel", [_SmoothedCE, _ChunkedSmoothedCE])
def test_both_loss_kernels_agree_on_bf16_logits(kernel: type[torch.autograd.Function]) -> None:
    """The GPU's one-buffer path also takes bf16 logits (widened once); here on the CPU."""
    logits = torch.randn(5, 7, 13, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(1, 13, (5, 7))
    target[1, 4:] = 0
    loss, _ = kernel.apply(logits.view(-1, 13), target.view(-1), 0.1, 0)
    loss.backward()
    ref_logits = logits.detach().float().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(
        ref_logits.view(-1, 13), target.view(-1), ignore_index=0, label_smoothing=0.1, reduction="sum"
    )
    ref.backward()
    torch.testing.assert_close(loss, ref, atol=1e-3, rtol=1e-5)
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("spread", [3.0, 300.0])
def test_the_chunked_kernel_computes_the_loss_and_gradient_to_fp32_rounding(spread: float) -> None:
    """The chunks' log-sum-exp and one-exponential gradient, run on fp32 logits so that bf16 rounding
    hides nothing, against ``F.cross_entropy`` in fp64: 77 rows (two full chunks and a partial one),
    padding, and logits 300 apart (exp underflows to 0 for most of a row: the max is subtracted); the
    logits the kernel was given are left as they were."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(77, 50, generator=gen) * spread
    target = torch.randint(1, 50, (77,), generator=gen)
    target[5:9] = 0
    ours = logits.clone().requires_grad_(True)
    loss, nll = _ChunkedSmoothedCE.apply(ours, target, 0.1, 0, 0.5)
    (loss * 0.5).backward()
    ref_logits = logits.double().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(
        ref_logits, target, ignore_index=0, label_smoothing=0.1, reduction="sum"
    )
    (ref * 0.5).backward()
    ref_nll = torch.nn.functional.cross_entropy(logits.double(), target, ignore_index=0, reduction="sum")
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(nll.double(), ref_nll, rtol=1e-6, atol=0)
    assert ours.grad is not None and ours.grad.dtype == torch.float32
    # gradients reach 0.5 * 0.9 (the factor times 1 - eps): 3e-7 is five fp32 ulps at that size
    torch.testing.assert_close(ours.grad.double(), ref_logits.grad, rtol=0, atol=3e-7)
    assert torch.all(ours.grad[5:9] == 0)  # padding rows carry no gradient
    assert torch.equal(ours.detach(), logits)  # the chunks work in copies: fp32 logits are not overwritten


@pytest.mark.parametrize("kind", ["sinusoidal", "shaw+values", "t5", "rope"])
def test_beams_sharing_one_memory_equal_repeated_memory(kind: str) -> None:
    from dataclasses import replace

    model = tiny_model("shaw", shaw_values=True) if kind == "shaw+values" else tiny_model(kind)
    if kind in ("t5", "rope"):  # also exercise the cross-attention hooks
        model = tiny_model(kind, cross_position=kind)
    src = torch.randint(3, 40, (2, 7))
    src[1, 5:] = 0
    memory = model.encode(src)
    repeated = replace(
        memory,
        states=memory.states.repeat_interleave(3, 0),
        keep=memory.keep.repeat_interleave(3, 0),
    )
    grouped = replace(memory, group=3)
    tgt = torch.randint(3, 40, (6, 4))
    a, b = model.new_cache(), model.new_cache()
    for i in range(4):
        out_rep = model.decode(tgt[:, i : i + 1], repeated, a)
        out_grp = model.decode(tgt[:, i : i + 1], grouped, b)
        torch.testing.assert_close(out_grp, out_rep, atol=1e-5, rtol=1e-5)
    # a multi-token chunk with a group falls back to repeating the memory
    torch.testing.assert_close(model.decode(tgt, grouped), model.decode(tgt, repeated), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["sinusoidal", "t5", "rope"])
def test_beam_search_batch_equals_one_sentence_at_a_time(kind: str) -> None:
    # Sentences finish at different steps and leave the batch; the rest must be unaffected.
    model = tiny_model(kind)
    torch.manual_seed(1)
    src = torch.randint(3, 40, (5, 6))
    src[1, 3:] = 0
    src[3, 5:] = 0
    batched = beam_search(model, src, beam=3, max_len_a=1.0, max_len_b=4)
    for i in range(5):
        row = src[i : i + 1, : int((src[i] != 0).sum())]
        assert beam_search(model, row, beam=3, max_len_a=1.0, max_len_b=4) == [batched[i]]
    lengths = {len(h) for h in batched}
    assert len(lengths) > 1  # the sentences did finish at different steps


def test_kv_cache_reorders_and_shrinks_like_indexing_the_full_history() -> None:
    # Past the first capacity (64), through reorders of the same batch and a shrinking batch, the
    # cache holds exactly the appended keys/values indexed by the composed row selections.
    from tpe_train.model.attention import KVCache

    torch.manual_seed(0)
    cache, ks, vs = KVCache(), [], []
    rows = 6
    for step in range(70):
        k, v = torch.randn(rows, 2, 1, 4), torch.randn(rows, 2, 1, 4)
        ks.append(k)
        vs.append(v)
        got_k, got_v = cache.append(k, v)
        torch.testing.assert_close(got_k, torch.cat(ks, dim=2), rtol=0, atol=0)
        torch.testing.assert_close(got_v, torch.cat(vs, dim=2), rtol=0, atol=0)
        index = torch.randint(0, rows, (rows - 1 if step in (30, 65) else rows,))
        cache.reorder(index)
        ks, vs = [k[index] for k in ks], [v[index] for v in vs]
        rows = index.numel()
    assert rows == 4 and cache.length == 70


def test_packed_linear_equals_the_plain_product_only_inside_inference() -> None:
    from tpe_train.model import kernels

    torch.manual_seed(0)
    layer = kernels.Linear(48, 300)
    x = torch.randn(5, 3, 48)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    kernels.set_cpu_gemm("onednn")  # pack whatever the processor (auto: where oneDNN is faster)
    with kernels.packed_inference():
        torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
        assert len(kernels._SCOPE.packed) == int(kernels._ONEDNN)  # packed once, reused
        torch.testing.assert_close(layer(x[:, :1]), expected[:, :1], atol=1e-5, rtol=1e-5)
        assert len(kernels._SCOPE.packed) == int(kernels._ONEDNN)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast keeps its bf16 product
            assert layer(x).dtype == torch.bfloat16
    assert not kernels._SCOPE.packed  # dropped at the end: a later change of the weights is seen
    with torch.no_grad():
        layer.weight.mul_(2)
    with kernels.packed_inference():
        torch.testing.assert_close(layer(x), 2 * (expected - layer.bias) + layer.bias, atol=1e-4, rtol=1e-5)
    kernels.set_cpu_gemm("default")  # PyTorch's kernel: nothing packed
    with kernels.packed_inference():
        torch.testing.assert_close(layer(x), 2 * (expected - layer.bias) + layer.bias, atol=1e-4, rtol=1e-5)
        assert not kernels._SCOPE.packed
    kernels.set_cpu_gemm("auto")
    out = layer(x)  # outside: autograd as ever
    out.sum().backward()
    assert layer.weight.grad is not None


@pytest.mark.parametrize("kind", [*KINDS, "shaw+values"])
def test_packed_incremental_decoding_equals_the_plain_full_pass(kind: str) -> None:
    # Inside packed_inference (greedy and beam search): packed weights, q/k/v in one product.
    from tpe_train.model import kernels

    model = tiny_model("shaw", shaw_values=True) if kind == "shaw+values" else tiny_model(kind)
    src = torch.randint(3, 40, (2, 7))
    src[1, 5:] = 0
    tgt = torch.randint(3, 40, (2, 6))
    with torch.no_grad():
        full = model.decode(tgt, model.encode(src))
    with kernels.packed_inference():
        memory, cache = model.encode(src), model.new_cache()
        steps = [model.decode(tgt[:, i : i + 1], memory, cache) for i in range(6)]
        # q|k|v of every layer, and cross-attention's k|v (projected once per memory)
        assert len(kernels._SCOPE.fused) == len(model.encoder.layers) + 2 * len(model.decoder.layers)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_fused_linears_equal_one_at_a_time_with_and_without_biases() -> None:
    from tpe_train.model import kernels

    torch.manual_seed(0)
    x = torch.randn(4, 3, 16)
    for biases in ((True, True), (False, False), (True, False)):
        layers = [kernels.Linear(16, 8, bias=biases[0]), kernels.Linear(16, 12, bias=biases[1])]
        with kernels.packed_inference():
            fused = kernels.linears(x, layers)
        with torch.no_grad():
            for got, layer in zip(fused, layers, strict=True):
                torch.testing.assert_close(got, torch.nn.functional.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("cast", [False, True])
def test_training_with_q_k_v_as_one_product_follows_separate_products(cast: bool) -> None:
    """Attention's projections as one product over concatenated weights (training, kernels.linears):
    the losses and every parameter's gradient of three products per layer, within rounding (fp32:
    1e-5 relative; bf16 autocast: the rounding of bf16 products, 2e-2 of the largest gradient), and
    one product where there were three (the autograd graph's linear nodes)."""
    from support.dist_harness import graph_nodes

    from tpe_train.model import kernels
    from tpe_train.model.attention import Attention

    def run(fuse: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        torch.manual_seed(0)
        model = tiny_model("t5")
        for module in model.modules():
            if isinstance(module, Attention):
                module.fuse_projections = fuse
        src, tgt = torch.randint(3, 40, (3, 9)), torch.randint(3, 40, (3, 7))
        src[2, 6:] = 0
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast):
            logits = model(src, tgt)
        loss = logits.float().logsumexp(-1).sum()
        loss.backward()
        cats = graph_nodes(logits, "CatBackward0")
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), grads, cats

    kernels.set_cpu_gemm("auto")
    loss, grads, cats = run(True)
    ref_loss, ref_grads, ref_cats = run(False)
    layers = len(tiny_model("t5").encoder.layers), len(tiny_model("t5").decoder.layers)
    assert cats - ref_cats == 2 * layers[0] + 4 * layers[1]  # weight and bias of q|k|v, cross k|v
    assert grads.keys() == ref_grads.keys()
    rtol = 2e-2 if cast else 1e-5
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=0)
    # key biases get gradients that are zero in exact arithmetic (softmax ignores a constant added
    # to every logit): rounding noise, compared on the scale of the largest gradient
    largest = max(float(g.abs().max()) for g in ref_grads.values())
    for name, grad in grads.items():
        ref = ref_grads[name]
        scale = largest if name.endswith(".k.bias") else max(float(ref.abs().max()), 1e-2 * largest)
        assert float((grad - ref).abs().max()) <= rtol * scale, (name, float((grad - ref).abs().max()), scale)
