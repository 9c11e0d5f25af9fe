"""Training-time position augmentation (SHAPE, CAPE, randomized positions): the draws follow their
distributions in training, and evaluation and decoding see exactly the positions of no augmentation
(randomized positions drawn at test time too: tests/test_position_randomized_test.py)."""

from __future__ import annotations

import math
import os
import socket
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from tests.support.models import tiny_model
from tpe_train.config.sections import Config
from tpe_train.model.position_stats import position_similarity
from tpe_train.model.transformer import Transformer
from tpe_train.parallel.context import ParallelContext
from tpe_train.parallel.plan import PositionParallelEmbedding
from tpe_train.positions import PositionArgs, build_position
from tpe_train.positions.absolute import sinusoid_table
from tpe_train.positions.augment import augment_positions
from tpe_train.positions.rotary import RotaryPosition

#: every supported (encoding, augmentation) pair
PAIRS = [
    ("sinusoidal", "shape"),
    ("sinusoidal", "cape"),
    ("sinusoidal", "randomized"),
    ("learned", "shape"),
    ("learned", "randomized"),
    ("rope", "shape"),
    ("rope", "cape"),
    ("rope", "randomized"),
]
PARAMS = dict(augment_max_shift=20, cape_shift=5.0, cape_jitter=0.5, cape_scale=1.5, randomized_range=48)


def pos_args(**kw: object) -> PositionArgs:
    return PositionArgs(d_model=32, n_heads=4, causal=False, max_positions=64, **kw)  # type: ignore[arg-type]


def model(kind: str, augment: str, **kw: object) -> Transformer:
    torch.manual_seed(0)
    return tiny_model(kind, position=pos_args(augment=augment, **PARAMS, **kw))


def batch() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(3, 40, (3, 7), generator=gen), torch.randint(3, 40, (3, 6), generator=gen)


def chi_square(counts: Tensor) -> float:
    expected = counts.sum().item() / counts.numel()
    return float(((counts.double() - expected) ** 2 / expected).sum())


@pytest.mark.parametrize(("kind", "augment"), PAIRS)
def test_evaluation_and_decoding_are_exactly_unaugmented(kind: str, augment: str) -> None:
    """randomized with randomized_test=false (the default draws at test time too:
    tests/test_position_randomized_test.py)."""
    plain, augmented = model(kind, "none"), model(kind, augment, randomized_test=False)
    augmented.load_state_dict(plain.state_dict())
    src, tgt = batch()
    augmented.train()
    assert not torch.allclose(augmented(src, tgt), plain.eval()(src, tgt), atol=1e-5) or kind == "rope"
    plain.eval(), augmented.eval()
    with torch.no_grad():
        assert torch.equal(augmented(src, tgt), plain(src, tgt))
        pair = (plain, augmented)
        memories = [m.encode(src) for m in pair]
        caches = [m.new_cache() for m in pair]
        for t in range(tgt.shape[1]):  # incremental decoding, one token at a time
            step = tgt[:, t : t + 1]
            steps = [m.decode(step, mem, c) for m, mem, c in zip(pair, memories, caches, strict=True)]
            assert torch.equal(steps[0], steps[1])


def test_rope_shape_is_a_no_op_and_other_rope_augments_are_not() -> None:
    """RoPE's q.k depends on i - j only: a SHAPE offset shared by the queries and keys of a sequence
    (and by every layer) leaves training outputs unchanged up to rounding; cape and randomized do not."""
    src, tgt = batch()
    plain = model("rope", "none").train()
    reference = plain(src, tgt)
    for augment, same in (("shape", True), ("cape", False), ("randomized", False)):
        other = model("rope", augment).train()
        other.load_state_dict(plain.state_dict())
        assert torch.allclose(other(src, tgt), reference, atol=1e-4) == same, augment


@pytest.mark.parametrize("augment", ["randomized", "cape"])
def test_rope_draws_once_per_batch_for_all_layers(augment: str) -> None:
    """cape always, randomized with randomized_per_layer=false: one draw per stack and batch."""
    args = pos_args(augment=augment, randomized_range=48, randomized_per_layer=False)
    enc = build_position("rope", args).train()
    assert isinstance(enc, RotaryPosition)
    pos = torch.arange(6)
    first = enc.augmented(pos, pos, 4)
    assert first[0] is first[1] and first[0].shape == (4, 6)
    assert enc.augmented(pos, pos, 4)[0] is first[0]  # the next layer: the same draw
    assert not torch.equal(enc.augmented(torch.arange(6), torch.arange(6), 4)[0], first[0])  # next batch
    cross = enc.augmented(pos, torch.arange(9), 4)
    assert cross[0] is pos  # cross-attention keeps its positions
    assert enc.eval().augmented(torch.arange(6), torch.arange(6), 4)[0].shape == (6,)


def test_rope_draws_randomized_positions_afresh_in_every_layer_by_default() -> None:
    """The reference's RoPE samples its randomized positions inside each attention layer: every call
    (a layer) draws anew; the queries and keys of one call share the draw."""
    enc = build_position("rope", pos_args(augment="randomized", randomized_range=48)).train()
    assert isinstance(enc, RotaryPosition) and enc.args.randomized_per_layer
    pos = torch.arange(6)
    torch.manual_seed(0)
    layers = [enc.augmented(pos, pos, 4) for _ in range(3)]
    for q_pos, k_pos in layers:
        assert q_pos is k_pos and q_pos.shape == (4, 6)
    assert not torch.equal(layers[0][0], layers[1][0]) and not torch.equal(layers[1][0], layers[2][0])
    torch.manual_seed(0)
    again = augment_positions(pos, 4, "randomized", randomized_range=48)
    assert torch.equal(layers[0][0], again)  # the first layer's draw is the generator's next one


def test_embed_adds_the_augmented_positions_in_training_only() -> None:
    enc = build_position("sinusoidal", pos_args(augment="shape", augment_max_shift=100)).train()
    x, pos = torch.zeros(5, 4, 32), torch.arange(4)
    torch.manual_seed(3)
    out = enc.embed(x, pos)
    torch.manual_seed(3)
    shifted = augment_positions(pos, 5, "shape", max_shift=100)
    torch.testing.assert_close(out, sinusoid_table(shifted.flatten(), 32).view(5, 4, 32))
    assert torch.equal(enc.eval().embed(x, pos), x + sinusoid_table(pos, 32))


def test_shape_offsets_are_uniform_and_shared_by_a_sequence() -> None:
    torch.manual_seed(0)
    k_max, n, length = 9, 20000, 5
    got = augment_positions(torch.arange(length), n, "shape", max_shift=k_max)
    offsets = got - torch.arange(length)
    assert (offsets == offsets[:, :1]).all()  # one offset for all positions of a sequence
    counts = torch.bincount(offsets[:, 0], minlength=k_max + 1)
    assert counts.numel() == k_max + 1 and (counts > 0).all()  # 0..K, nothing outside
    assert chi_square(counts) < 27.9  # chi-square, 9 degrees of freedom, p = 0.001
    assert len(set(offsets[:8, 0].tolist())) > 1  # the sequences of a batch differ


def test_cape_shift_jitter_and_scale_follow_their_bounds() -> None:
    torch.manual_seed(0)
    n, i = 20000, torch.arange(1, 9)
    shifted = augment_positions(i, n, "cape", cape_shift=5.0) - i
    assert torch.allclose(shifted, shifted[:, :1]) and shifted.abs().max() <= 5.0
    assert abs(shifted[:, 0].mean()) < 0.1 and shifted[:, 0].var() == pytest.approx(25 / 3, rel=0.05)
    jitter = augment_positions(i, n, "cape", cape_jitter=0.5) - i
    assert jitter.abs().max() <= 0.5 and jitter.abs().max() > 0.49 and abs(jitter.mean()) < 0.01
    scale = augment_positions(i, n, "cape", cape_scale=2.0) / i
    assert torch.allclose(scale, scale[:, :1])
    log_scale = scale[:, 0].log()
    assert log_scale.abs().max() <= math.log(2.0) + 1e-12
    assert abs(log_scale.mean()) < 0.01 and log_scale.var() == pytest.approx(math.log(2) ** 2 / 3, rel=0.05)
    full = augment_positions(i, n, "cape", cape_shift=5.0, cape_jitter=0.5, cape_scale=1.03)
    assert full.dtype == torch.float64 and (full.diff(dim=1) > 0).all()  # jitter <= 1/2 keeps the order


def test_randomized_positions_are_sorted_distinct_in_range_and_uniform() -> None:
    torch.manual_seed(0)
    r, length, n = 16, 5, 10000
    got = augment_positions(torch.arange(length), n, "randomized", randomized_range=r)
    assert got.dtype == torch.long and (got.diff(dim=1) > 0).all()  # sorted and distinct
    assert got.min() >= 0 and got.max() < r
    assert chi_square(torch.bincount(got.flatten(), minlength=r)) < 37.7  # 15 d.o.f., p = 0.001
    assert chi_square(torch.bincount(got[:, 0], minlength=r)[: r - length + 1]) > 1000  # the first: small
    with pytest.raises(ValueError, match="randomized_range"):
        augment_positions(torch.arange(20), 2, "randomized", randomized_range=r)


@pytest.mark.parametrize(("kind", "augment"), PAIRS)
def test_a_training_step_runs(kind: str, augment: str) -> None:
    net = model(kind, augment).train()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    src, tgt = batch()
    for _ in range(2):
        logits = net(src, tgt[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)


def config(**position: object) -> Config:
    return Config.model_validate({"data": {"max_len": 50}, "model": {"position": position}})


@pytest.mark.parametrize(
    ("position", "message"),
    [
        ({"kind": "learned", "augment": "cape"}, "integer positions only"),
        ({"kind": "t5", "augment": "shape"}, "augment=none"),
        ({"kind": "alibi", "augment": "randomized"}, "augment=none"),
        ({"kind": "xpos", "augment": "shape"}, "augment=none"),
        ({"kind": "shaw", "augment": "cape"}, "augment=none"),
        ({"kind": "none", "augment": "shape"}, "augment=none"),
        ({"kind": "learned", "augment": "shape", "max_positions": 100}, "at least 551"),
        ({"kind": "sinusoidal", "augment": "randomized", "randomized_range": 51}, "raise randomized_range"),
        ({"kind": "learned", "augment": "randomized", "randomized_range": 200, "max_positions": 100}, "rows"),
        ({"kind": "sinusoidal", "augment": "cape", "cape_jitter": 0.6}, "cape_jitter"),
        ({"kind": "sinusoidal", "augment": "spin"}, "augment"),
    ],
)
def test_config_refuses_what_does_not_apply(position: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config(**position)


def test_config_passes_parameters_and_refuses_compiled_rope() -> None:
    cfg = config(kind="learned", augment="shape", augment_max_shift=10, max_positions=61)
    assert cfg.model.args(40, 0, 1, 2).position.augment_max_shift == 10  # type: ignore[union-attr]
    rope = {"position": {"kind": "rope", "augment": "cape"}}
    with pytest.raises(ValueError, match=r"train\.compile"):
        Config.model_validate({"model": rope, "train": {"compile": True}})


def test_position_diagnostics_read_the_plain_positions_in_training() -> None:
    """The table image of a training model shows rows 0..P-1, not a shifted draw past the table."""
    net = model("learned", "shape").train()
    similarity = position_similarity(net, 10)
    assert similarity["encoder"].shape == (64, 64) and net.encoder.pos(0).training
    torch.testing.assert_close(similarity["encoder"], position_similarity(net.eval(), 10)["encoder"])


def table_and_positions() -> tuple[torch.nn.Embedding, Tensor]:
    torch.manual_seed(0)
    return torch.nn.Embedding(64, 8), torch.randint(0, 64, (3, 5))


def lookup_worker(rank: int, port: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        ctx = ParallelContext(2, rank, rank, tp_size=2, tp_group=dist.group.WORLD)
        full, pos = table_and_positions()
        with torch.no_grad():
            out.put((rank, PositionParallelEmbedding(full, ctx)(pos).numpy()))
    finally:
        dist.destroy_process_group()


def test_a_split_learned_table_looks_up_per_sequence_positions() -> None:
    """Tensor parallelism splits a learned table by rows; augmented training positions are (B, L)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    out = context.Queue()
    procs = [context.Process(target=lookup_worker, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    full, pos = table_and_positions()
    for rank in range(2):
        torch.testing.assert_close(torch.from_numpy(results[rank]), full(pos).detach())
