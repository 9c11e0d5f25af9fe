"""The test-time ``shift`` of an absolute encoding (``--position sinusoidal.shift=K``): self-attention's
positions K, K+1, ... in evaluation and in every decoding path, the check of SHAPE's shift invariance."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tests.support.models import tiny_model
from tpe_train.evaluation.position_settings import apply_position_settings
from tpe_train.model.generate import beam_search, greedy
from tpe_train.model.transformer import Transformer
from tpe_train.positions import PositionArgs

KINDS = ["sinusoidal", "learned", "rope"]


def model(kind: str, augment: str = "none", **kw: object) -> Transformer:
    torch.manual_seed(0)
    position = PositionArgs(d_model=32, n_heads=4, causal=False, max_positions=64, augment=augment, **kw)
    return tiny_model(kind, position=position).eval()


def batch() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(3, 40, (3, 7), generator=gen), torch.randint(3, 40, (3, 6), generator=gen)


def shifted(kind: str, k: int) -> Transformer:
    net = model(kind)
    assert apply_position_settings(net, [f"{kind}.shift={k}"]) == [
        f"encoder: {kind}.shift={k}", f"decoder: {kind}.shift={k}"
    ]  # fmt: skip
    return net


@pytest.mark.parametrize("kind", ["sinusoidal", "learned"])
def test_a_shift_feeds_positions_k_and_up_to_the_absolute_encodings(kind: str) -> None:
    src, tgt = batch()
    seen: list[Tensor] = []
    net = shifted(kind, 5)
    hook = type(net.encoder.pos(0)).embed

    def spy(self: object, x: Tensor, pos: Tensor) -> Tensor:
        seen.append(pos.clone())
        return hook(self, x, pos)  # type: ignore[arg-type]

    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(net.encoder.pos(0)), "embed", spy)
        moved = net(src, tgt)
    assert [p.tolist() for p in seen] == [list(range(5, 12)), list(range(5, 11))]  # encoder, decoder
    with torch.no_grad():
        assert not torch.allclose(moved, model(kind)(src, tgt), atol=1e-4)
        assert torch.equal(shifted(kind, 0)(src, tgt), model(kind)(src, tgt))  # 0: bitwise unchanged


def test_rope_under_a_shift_changes_only_by_rounding() -> None:
    src, tgt = batch()
    with torch.no_grad():
        torch.testing.assert_close(
            shifted("rope", 7)(src, tgt), model("rope")(src, tgt), atol=1e-4, rtol=1e-4
        )


@pytest.mark.parametrize("kind", KINDS)
def test_incremental_decoding_continues_the_shifted_positions(kind: str) -> None:
    net = shifted(kind, 9)
    src, tgt = batch()
    with torch.no_grad():
        memory = net.encode(src)
        full = net.decode(tgt, memory)  # teacher-forced, no cache: test_positions
        cache = net.new_cache(src.shape[1], 12)
        assert cache.positions is not None and cache.positions.tolist() == list(range(9, 21))
        steps = torch.cat([net.decode(tgt[:, t : t + 1], memory, cache) for t in range(tgt.shape[1])], dim=1)
        torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)
        assert greedy(net, src, max_len_b=8) == greedy(net, src, max_len_b=8)
        assert len(beam_search(net, src, beam=3, max_len_b=8)) == src.shape[0]


def test_a_learned_table_refuses_a_shifted_input_past_its_rows() -> None:
    net = shifted("learned", 60)  # 64 rows: positions 60..63 are left, 4 tokens
    assert net.max_source_length() == 4
    with torch.no_grad(), pytest.raises(ValueError, match="source"):
        net.encode(torch.randint(3, 40, (1, 5)))


def test_bad_shifts_and_encodings_without_one_are_refused() -> None:
    with pytest.raises(ValueError, match="offset of 0 or more"):
        apply_position_settings(model("sinusoidal"), ["sinusoidal.shift=-1"])
    with pytest.raises(ValueError, match="not a valid int"):
        apply_position_settings(model("sinusoidal"), ["sinusoidal.shift=2.5"])
    with pytest.raises(ValueError, match="no test-time setting shift"):
        apply_position_settings(tiny_model("alibi"), ["alibi.shift=3"])
    drawn = model("learned", augment="randomized", randomized_range=48)
    with pytest.raises(ValueError, match="randomized_test=false"):
        apply_position_settings(drawn, ["learned.shift=3"])
    apply_position_settings(drawn, ["learned.randomized_test=false", "learned.shift=3"])
    assert drawn.encoder.pos(0).test_positions(torch.arange(3)).tolist() == [3, 4, 5]
