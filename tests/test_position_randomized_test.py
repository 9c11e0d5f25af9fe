"""Randomized positions at test time (``model.position.randomized_test``, Ruoss et al.'s reference
draws whenever its model runs): the draws' form, the model's use of them in evaluation and decoding,
repeatable evaluation that leaves training's generator alone, and exporters that refuse such a model."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from torch import Tensor

from tests.support.models import tiny_model
from tpe_train.ckpt.ct2 import check_exportable
from tpe_train.ckpt.errors import CheckpointError
from tpe_train.ckpt.hf import hf_target
from tpe_train.evaluation.position_settings import apply_position_settings
from tpe_train.model.generate import beam_search, greedy
from tpe_train.model.transformer import Transformer
from tpe_train.positions import PositionArgs
from tpe_train.positions.augment import decode_draw, eval_draw

R = 48
KINDS = ["sinusoidal", "learned", "rope"]


def model(kind: str, drawn: bool = True, **kw: object) -> Transformer:
    torch.manual_seed(0)
    position = PositionArgs(
        d_model=32, n_heads=4, causal=False, max_positions=64, augment="randomized", randomized_range=R,
        randomized_test=drawn,
    )  # fmt: skip
    return tiny_model(kind, position=position, **kw).eval()


def batch() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(3, 40, (3, 7), generator=gen), torch.randint(3, 40, (3, 6), generator=gen)


def test_a_test_draw_is_sorted_distinct_in_range_and_repeatable() -> None:
    draws = [eval_draw(10, R, torch.Generator().manual_seed(s)) for s in (0, 0, 1)]
    first = draws[0]
    assert first.shape == (10,) and (first.diff() > 0).all() and first.min() >= 0 and first.max() < R
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    with pytest.raises(ValueError, match="randomized_test=false"):
        eval_draw(R + 1, R, torch.Generator())


def test_a_decoding_draw_starts_as_a_draw_of_the_source_length_and_continues_above_it() -> None:
    gen = torch.Generator().manual_seed(0)
    got = decode_draw(8, 30, R, gen)
    assert got.shape == (30,) and torch.equal(got[:8], eval_draw(8, R, torch.Generator().manual_seed(0)))
    top = int(got[7])
    above = got[8 : 8 + min(22, R - 1 - top)]
    assert (above > top).all() and (above.diff() > 0).all()
    assert (got[8 + above.numel() :] == R - 1).all()  # positions ran out: the last one, R-1
    exhausted = decode_draw(8, 200, R, torch.Generator().manual_seed(0))
    assert exhausted.shape == (200,) and exhausted.max() == R - 1 and (exhausted.diff() >= 0).all()
    assert torch.equal(decode_draw(20, 5, R, torch.Generator().manual_seed(3)),
                       eval_draw(5, R, torch.Generator().manual_seed(3)))  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_evaluation_draws_positions_repeatably_without_moving_training_rng(kind: str) -> None:
    drawn, plain = model(kind), model(kind, drawn=False)
    src, tgt = batch()
    with torch.no_grad():
        state = torch.get_rng_state()
        first = drawn(src, tgt)
        assert torch.equal(torch.get_rng_state(), state)  # training's generator untouched
        second = drawn(src, tgt)
        drawn.eval()  # evaluation restarts the draws
        again = drawn(src, tgt)
        reference = plain(src, tgt)
    assert torch.equal(first, again) and not torch.equal(first, second)  # each batch a new draw
    assert not torch.allclose(first, reference, atol=1e-4)  # positions 0..L-1 give other outputs
    memory = drawn.encode(src)
    assert torch.equal(memory.positions, torch.arange(src.shape[1]))  # cross-attention's: as in training


@pytest.mark.parametrize("kind", KINDS)
def test_incremental_decoding_reads_the_positions_drawn_for_the_search(kind: str) -> None:
    net = model(kind)
    src, tgt = batch()
    with torch.no_grad():
        memory = net.encode(src)
        whole = net.new_cache(src.shape[1], 12)
        steps = net.new_cache(src.shape[1], 12)
        steps.positions = whole.positions
        assert whole.positions is not None and whole.positions.shape == (12,)
        chunk = net.decode(tgt, memory, whole)  # every step at once, causal by position
        one = torch.cat([net.decode(tgt[:, t : t + 1], memory, steps) for t in range(tgt.shape[1])], dim=1)
        torch.testing.assert_close(one, chunk, atol=1e-5, rtol=1e-5)
        short = net.new_cache(src.shape[1], 3)
        with pytest.raises(ValueError, match="new_cache"):
            net.decode(tgt, memory, short)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_and_beam_search_decode_with_drawn_positions_repeatably(kind: str) -> None:
    net = model(kind)
    src, _ = batch()
    outputs = []
    for _ in range(2):
        net.eval()
        outputs.append((greedy(net, src, max_len_b=10), beam_search(net, src, beam=3, max_len_b=10)))
    assert outputs[0] == outputs[1]
    assert all(len(hyp) <= src.shape[1] + 10 for hyp in outputs[0][0])


def test_exporters_refuse_a_model_that_draws_its_positions() -> None:
    net = model("learned", pre_norm=True)
    with pytest.raises(CheckpointError, match="draws its self-attention positions"):
        hf_target(net.args)
    with pytest.raises(CheckpointError, match="CTranslate2 feeds positions 0, 1, 2"):
        check_exportable(net, Tokenizer(WordLevel({"a": 0}, unk_token="a")), "float32")
    assert net.args.position is not None
    undrawn = replace(net.args, position=replace(net.args.position, randomized_test=False))
    assert hf_target(undrawn).model_type == "blenderbot"


def test_the_test_time_setting_turns_the_draws_on_and_off() -> None:
    drawn, plain = model("learned"), model("learned", drawn=False)
    src, tgt = batch()
    assert apply_position_settings(drawn, ["learned.randomized_test=false"]) == [
        "encoder: learned.randomized_test=false", "decoder: learned.randomized_test=false"
    ]  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(drawn.eval()(src, tgt), plain(src, tgt), atol=0, rtol=0)
        apply_position_settings(plain, ["learned.randomized_test=true"])
        assert not torch.allclose(plain.eval()(src, tgt), drawn(src, tgt), atol=1e-4)
    with pytest.raises(ValueError, match="give true or false"):
        apply_position_settings(drawn, ["learned.randomized_test=maybe"])
    for kind in ("t5", "learned"):  # never takes randomized; not trained with it
        with pytest.raises(ValueError, match="no test-time setting randomized_test"):
            apply_position_settings(tiny_model(kind), [f"{kind}.randomized_test=true"])
