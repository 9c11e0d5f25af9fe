"""The vocabulary-parallel output layer and loss (``tpe_train/parallel/vocab.py``) against the loss of
one process, on 2 and 3 gloo processes: the loss, the nll, and the gradients of the decoder output
and of the tied embedding (lookup + output layer, after the group's sum) within fp32 rounding.

The whole trainer under tensor parallelism (AutoTP, 2 ranks, every encoding, ZeRO-1 and ZeRO-3,
TP 2 x DP 2) takes its loss this way and is compared with one process in ``test_distributed.py``.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tpe_train.model.chunked_loss import ChunkedLoss
from tpe_train.model.loss import label_smoothed_loss
from tpe_train.parallel.context import ParallelContext
from tpe_train.parallel.vocab import VocabParallelScore, scale_lookup_gradient

pytestmark = pytest.mark.integration  # starts processes

VOCAB, D, PAD = 37, 16, 0  # 37 words: blocks of 19 + 18 (2 ranks) and 13 + 13 + 11 (3 ranks)


def problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB, D, generator=g)
    ids = torch.randint(1, VOCAB, (4, 6), generator=g)
    h = torch.randn(4, 6, D, generator=g)
    target = torch.randint(1, VOCAB, (4, 6), generator=g)
    target[0, 4:] = PAD
    target[2, :2] = VOCAB - 1  # the last word: the last, shorter block
    return weight, ids, h, target


def reference(chunk: int) -> dict[str, Any]:
    weight, ids, h, target = problem()
    weight.requires_grad_(True)
    h.requires_grad_(True)
    lookup = torch.nn.functional.embedding(ids, weight).sum()
    loss, nll, _ = label_smoothed_loss(h @ weight.T, target, PAD, 0.1)
    (loss + lookup).backward()
    return {"loss": float(loss), "nll": float(nll), "h": h.grad, "weight": weight.grad}


def worker(rank: int, size: int, port: int, chunk: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        ctx = ParallelContext(size, rank, rank, tp_size=size, tp_group=dist.group.WORLD)
        weight, ids, h, target = problem()
        embed = torch.nn.Embedding(VOCAB, D)
        with torch.no_grad():
            embed.weight.copy_(weight)
        scale_lookup_gradient(embed, ctx)
        h.requires_grad_(True)
        head = ChunkedLoss(target, PAD, 0.1, chunk, score=VocabParallelScore(ctx), recompute=chunk > 0)
        loss, nll, _ = head(h, embed.weight)
        (loss + embed(ids).sum()).backward()
        grads = {"h": h.grad.numpy(), "weight": embed.weight.grad.numpy()}  # by value: the process ends
        out.put((rank, {"loss": float(loss), "nll": float(nll), **grads}))
    finally:
        dist.destroy_process_group()


def run(size: int, chunk: int) -> list[dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    out = context.Queue()
    procs = [context.Process(target=worker, args=(r, size, port, chunk, out)) for r in range(size)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return [results[r] for r in range(size)]


@pytest.mark.parametrize(("size", "chunk"), [(2, 0), (3, 5)])
def test_each_rank_gives_the_loss_and_gradients_of_one_process(size: int, chunk: int) -> None:
    """Chunks of 5 tokens (recomputed in the backward) or the whole batch; uneven vocabulary blocks."""
    ref = reference(chunk)
    for got in run(size, chunk):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        assert got["nll"] == pytest.approx(ref["nll"], rel=1e-6)
        torch.testing.assert_close(torch.from_numpy(got["h"]), ref["h"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.from_numpy(got["weight"]), ref["weight"], rtol=1e-5, atol=1e-6)
