"""train.loss_chunk_tokens: the output layer and the loss chunk by chunk, recomputed in the backward.
The values of the whole-batch loss up to the order of summation, with and without checkpointed layers,
in fp32 and bf16 autocast; and the step's peak memory (live tensor bytes, torch's MemTracker) that no
layer checkpoint lowers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

import tpe_train.parallel.checkpointing as ac
from tpe_train.config import ConfigError, load_config
from tpe_train.model.args import ModelArgs
from tpe_train.model.chunked_loss import ChunkedLoss
from tpe_train.model.loss import label_smoothed_loss
from tpe_train.model.transformer import Transformer
from tpe_train.positions import PositionArgs


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def model(d: int = 64, layers: int = 3, vocab: int = 300, kind: str = "rope") -> Transformer:
    torch.manual_seed(0)
    pos = PositionArgs(d_model=d, n_heads=4, causal=False, max_positions=256)
    args = ModelArgs(
        vocab_size=vocab, d_model=d, n_heads=4, ffn_dim=4 * d, encoder_layers=layers,
        decoder_layers=layers, dropout=0.1, encoder_position=kind, decoder_position=kind, position=pos,
    )  # fmt: skip
    return Transformer(args).train()


def batch(vocab: int, rows: int = 6, length: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(3, vocab, (rows, length), generator=gen)
    tgt = torch.randint(3, vocab, (rows, length + 1), generator=gen)
    tgt[0, 12:] = 0  # padding: not scored
    return src, tgt


def step(net: Transformer, src: torch.Tensor, tgt: torch.Tensor, chunk: int, cast: bool = False) -> Any:
    """(loss, nll, tokens, gradients) of one forward + backward; the same dropout masks every time."""
    torch.manual_seed(5)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast):
        if chunk:
            loss, nll, ntok = net(src, tgt[:, :-1], ChunkedLoss(tgt[:, 1:], 0, 0.1, chunk, 0.01))
        else:
            loss, nll, ntok = label_smoothed_loss(net(src, tgt[:, :-1]), tgt[:, 1:], 0, 0.1, 0.01)
    (loss * 0.01).backward()
    grads = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
    return loss.detach(), nll, int(ntok), grads


@pytest.mark.parametrize("checkpointed", [False, True])
def test_chunks_give_the_whole_batch_loss_and_gradients(checkpointed: bool) -> None:
    """fp32, dropout on, 111 target tokens in chunks of 16 (the last one short) and of one token:
    loss and nll within 1e-6 relative, every gradient within 1e-5 relative (the output weight's is a
    sum over chunks; the other rows' gradients are the same products)."""
    src, tgt = batch(300)
    whole = step(model(), src, tgt, 0)
    assert whole[2] == 6 * 20 - 9
    for chunk in (16, 1):
        net = model()
        if checkpointed:
            ac.apply_activation_checkpointing(net, "layers")
        loss, nll, ntok, grads = step(net, src, tgt, chunk)
        assert ntok == whole[2]
        torch.testing.assert_close(loss, whole[0], rtol=1e-6, atol=0)
        torch.testing.assert_close(nll, whole[1], rtol=1e-6, atol=0)
        assert grads.keys() == whole[3].keys()
        for name, grad in grads.items():
            torch.testing.assert_close(
                grad, whole[3][name], rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}"
            )


def test_in_bf16_autocast_the_chunks_follow_the_whole_batch() -> None:
    """The CPU's bf16 loss kernel (chunked rows, the gradient made in the forward) inside each chunk:
    the loss within 1e-4 relative; every gradient element within 2% relative or within its tensor's
    largest magnitude times bf16's unit roundoff, 2^-8 (the output weight's gradient is a sum of bf16
    products over chunks)."""
    src, tgt = batch(300)
    whole = step(model(), src, tgt, 0, cast=True)
    loss, _, _, grads = step(model(), src, tgt, 32, cast=True)
    torch.testing.assert_close(loss, whole[0], rtol=1e-4, atol=0)
    for name, grad in grads.items():
        atol = 2**-8 * float(whole[3][name].abs().max())
        torch.testing.assert_close(
            grad, whole[3][name], rtol=2e-2, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_without_gradients_the_chunks_are_scored_once() -> None:
    """Validation: the same sums, and nothing kept for a backward (no checkpoint, no graph)."""
    net = model().eval()
    src, tgt = batch(300)
    calls = 0
    real = ChunkedLoss._chunk

    def counted(self: ChunkedLoss, *args: Any) -> Any:
        nonlocal calls
        calls += 1
        return real(self, *args)

    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        whole = label_smoothed_loss(net(src, tgt[:, :-1]), tgt[:, 1:], 0, 0.1)
        mp.setattr(ChunkedLoss, "_chunk", counted)
        loss, nll, ntok = net(src, tgt[:, :-1], ChunkedLoss(tgt[:, 1:], 0, 0.1, 50))
    assert calls == 3 and loss.grad_fn is None  # 120 rows: 50 + 50 + 20
    torch.testing.assert_close((loss, nll), whole[:2], rtol=1e-6, atol=0)
    assert int(ntok) == int(whole[2])


def peak_above_weights(net: Transformer, src: torch.Tensor, tgt: torch.Tensor, chunk: int) -> float:
    """The most bytes of live tensors during one forward + backward, less the parameters (MiB)."""
    tracker = MemTracker()
    tracker.track_external(net)
    with tracker:
        step(net, src, tgt, chunk)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return (peak - sum(p.numel() * p.element_size() for p in net.parameters())) / 2**20


@pytest.mark.slow
def test_with_checkpointed_layers_the_chunks_remove_the_logits_from_the_peak() -> None:
    """The regime of the H200's measurement (docs/distributed.md): many target tokens per output row,
    where the logits, the loss's log-probabilities and their gradient (tokens x vocabulary) outlast
    every layer checkpoint. Here 32 x 64 tokens over 8,000 words (d 128, 6 + 6 layers): the chunks of
    512 tokens take the checkpointed step's peak below half, and 2.5x below the plain step's."""
    src, tgt = batch(8000, rows=32, length=64)
    plain = peak_above_weights(model(128, 6, 8000), src, tgt, 0)
    peaks = []
    for chunk in (0, 512):
        net = model(128, 6, 8000)
        ac.apply_activation_checkpointing(net, "layers")
        peaks.append(peak_above_weights(net, src, tgt, chunk))
    layers, chunked = peaks
    print(f"peak above the weights: plain {plain:.1f} MiB, layers {layers:.1f} MiB, "
          f"layers + chunks of 512 {chunked:.1f} MiB ({plain / chunked:.1f}x lower)")  # fmt: skip
    assert chunked < layers / 2 and plain / chunked >= 2.5


def test_the_chunk_is_a_validated_key() -> None:
    assert load_config("demo").train.loss_chunk_tokens == 0
    assert load_config("demo", ["train.loss_chunk_tokens=2048"]).train.loss_chunk_tokens == 2048
    with pytest.raises(ConfigError, match="loss_chunk_tokens"):
        load_config("demo", ["train.loss_chunk_tokens=-1"])
