"""Position diagnostics: the mean attention distance against hand-computed values, the model's own
probabilities (they reproduce its attention output for every encoding), the default forward untouched,
and the figures a short training run writes to TensorBoard at its interval, equal to tpe-eval's."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from support.models import KINDS, tiny_model
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor

from tpe_train.config import ConfigError, load_config
from tpe_train.data.batching import BOS_ID, EOS_ID, pad
from tpe_train.model.attention import Attention
from tpe_train.model.position_stats import attention_distances, mean_distance
from tpe_train.model.transformer import Transformer
from tpe_train.train.cadence import Cadence


def batch() -> tuple[Tensor, Tensor]:
    """Three sources and targets of different lengths, right-padded."""
    gen = torch.Generator().manual_seed(3)
    src_rows = [torch.randint(4, 40, (n,), generator=gen).tolist() for n in (9, 5, 7)]
    tgt_rows = [torch.randint(4, 40, (n,), generator=gen).tolist() for n in (6, 8, 3)]
    return pad([[*r, EOS_ID] for r in src_rows]), pad(tgt_rows, prefix=BOS_ID)


def test_mean_distance_equals_a_hand_computed_value() -> None:
    # batch 2, heads 2, 3 queries x 3 keys; row 1 of the batch has a padded last query
    eye = torch.eye(3)
    spread = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0], [0.25, 0.25, 0.5]])
    weights = torch.stack([torch.stack([eye, spread]), torch.stack([spread, spread])])  # (2, 2, 3, 3)
    pos = torch.arange(3)
    real = torch.tensor([[True, True, True], [True, True, False]])
    got = mean_distance(weights, pos, pos, real)
    # sum_j p_ij |i - j| of the spread rows: 0.5*1 + 0.5*2 = 1.5; 1*1 = 1; 0.25*2 + 0.25*1 = 0.75
    head0 = (0 + 0 + 0 + 1.5 + 1.0) / 5  # eye in row 0 (3 real queries), spread in row 1 (2)
    head1 = (1.5 + 1.0 + 0.75 + 1.5 + 1.0) / 5
    assert got.tolist() == pytest.approx([head0, head1], abs=1e-12)
    # positions with an offset (a query at position 5 over keys 0..5): the distances are |5 - j|
    one = torch.tensor([0.5, 0, 0, 0, 0, 0.5]).view(1, 1, 1, 6)
    assert mean_distance(one, torch.tensor([5]), torch.arange(6), torch.tensor([[True]])).item() == 2.5


def _recorded(model: Transformer, src: Tensor, tgt_in: Tensor) -> tuple[dict[Attention, Any], dict]:
    """Per self-attention module: its (input, pos, mask, output) in the default forward, and its
    probabilities handed to a probe in a second forward."""
    seen: dict[Attention, Any] = {}
    probs: dict[Attention, Tensor] = {}
    selfs = [layer.self_attn for stack in (model.encoder, model.decoder) for layer in stack.layers]
    hooks = [
        a.register_forward_hook(lambda m, args, out: seen.__setitem__(m, (*args[:3], out.detach())))
        for a in selfs
    ]
    with torch.no_grad():
        model(src, tgt_in)
    for h in hooks:
        h.remove()
    for a in selfs:
        a.probe = lambda w, q_pos, k_pos, a=a: probs.__setitem__(a, (w, q_pos, k_pos))
    try:
        with torch.no_grad():
            model(src, tgt_in)
    finally:
        for a in selfs:
            a.probe = None
    return seen, probs


@pytest.mark.parametrize("kind", [*KINDS, "shaw+values"])
def test_the_probabilities_handed_over_reproduce_the_attention_output(kind: str) -> None:
    """p @ v (plus Shaw's relative values where on), through the output projection, equals the
    output of the default forward (another backend: sdpa) within 1e-5, for every encoding."""
    model = tiny_model(kind.split("+")[0], shaw_values=kind.endswith("values"))
    src, tgt_in = batch()
    seen, probs = _recorded(model, src, tgt_in)
    assert len(probs) == 4
    for attn, (x, pos, mask, out) in seen.items():
        p, q_pos, k_pos = probs[attn]
        assert torch.equal(q_pos, mask.q_pos) and torch.equal(k_pos, mask.k_pos)
        assert torch.allclose(p.sum(-1), torch.ones(()), atol=1e-6)  # rows of probabilities
        with torch.no_grad():
            v = attn._split(attn.v(x))
            heads = p @ v + (pos.value_term(p, q_pos, k_pos) if pos.needs_weights else 0)
            again = attn.out(heads.transpose(1, 2).reshape(x.shape))
        assert pos.needs_weights == (kind == "shaw+values")
        torch.testing.assert_close(again, out, atol=1e-5, rtol=0)


def test_every_encoding_gives_finite_distances_within_the_lengths() -> None:
    src, tgt_in = batch()
    for kind in KINDS:
        d = attention_distances(tiny_model(kind), src, tgt_in)
        assert d.encoder.shape == d.decoder.shape == (2, 4) and d.heads == [0, 1, 2, 3]
        for table, length in ((d.encoder, src.shape[1]), (d.decoder, tgt_in.shape[1])):
            assert torch.isfinite(table).all() and (table >= 0).all() and (table < length).all(), kind
        assert (d.encoder > 0).all(), kind  # random weights attend to more than the query itself


def test_alibi_with_strong_slopes_attends_nearer_than_no_encoding() -> None:
    alibi = tiny_model("alibi")
    alibi.encoder.pos(0).adapt(slope_scale="16")
    alibi.decoder.pos(0).adapt(slope_scale="16")
    none = tiny_model("none")
    none.load_state_dict(alibi.state_dict())  # the same weights: only the bias differs
    src, tgt_in = batch()
    near, far = attention_distances(alibi, src, tgt_in), attention_distances(none, src, tgt_in)
    for side in ("encoder", "decoder"):
        assert (near.side(side) < far.side(side)).all(), side  # every layer and head
        assert (near.side(side)[:, 0] < 0.1).all(), side  # head 0's slope, 16/4: next to itself
        assert near.side(side).mean() < 0.7 * far.side(side).mean(), side


def _attention_modules(model: torch.nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def test_the_default_forward_is_bitwise_unchanged_and_nothing_is_left_probed() -> None:
    src, tgt_in = batch()
    for kind in KINDS:
        model = tiny_model(kind)  # in evaluation mode
        with torch.no_grad():
            before = model(src, tgt_in)
        rng = torch.get_rng_state()
        attention_distances(model, src, tgt_in)
        assert torch.equal(torch.get_rng_state(), rng), kind  # draws no random numbers
        assert all(a.probe is None for a in _attention_modules(model))
        with torch.no_grad():
            assert torch.equal(model(src, tgt_in), before), kind
        model.train()
        attention_distances(model, src, tgt_in)
        assert model.training, kind  # the mode it was in comes back
    learned = tiny_model("learned")  # the probes go even when the forward fails
    with pytest.raises(ValueError, match="beyond the learned position table"):
        attention_distances(learned, torch.full((1, 70), 5), tgt_in[:1])
    assert all(a.probe is None for a in _attention_modules(learned)) and not learned.training


def test_the_interval_is_a_validated_key_and_the_last_step_is_measured() -> None:
    cfg = load_config("demo", ["train.max_steps=10", "train.diagnostics_every=4"])
    assert [s for s in range(1, 11) if Cadence.of(cfg.train).should_diagnose(s)] == [4, 8, 10]
    off = load_config("demo", ["train.max_steps=10", "train.diagnostics_every=0"])
    assert not any(Cadence.of(off.train).should_diagnose(s) for s in range(1, 11))
    images = load_config("demo", ["train.max_steps=11", "train.diagnostics_every=2", "train.valid_every=3"])
    assert [s for s in range(1, 12) if Cadence.of(images.train).should_draw_tables(s)] == [6, 11]
    assert load_config("demo").train.diagnostics_every == 100
    with pytest.raises(ConfigError, match="diagnostics_every"):
        load_config("demo", ["train.diagnostics_every=-1"])


@pytest.mark.slow
def test_training_writes_the_diagnostics_at_its_interval_and_tpe_eval_measures_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tpe_train.ckpt.export import load_export
    from tpe_train.evaluation.cli import eval_main
    from tpe_train.evaluation.evaluate import corpus_sets
    from tpe_train.evaluation.position_report import diagnostic_batch
    from tpe_train.train.loop import run

    monkeypatch.setenv("TPE_DATA_CACHE", str(tmp_path / "data"))
    run_dir = tmp_path / "run"
    run(load_config("demo", [
        "model.d_model=32", "model.n_heads=4", "model.ffn_dim=64", "model.encoder_layers=2",
        "model.decoder_layers=2", "model.position.kind=learned", "model.position.max_positions=48",
        "data.max_len=40", "data.vocab_size=100", "data.synthetic.train_size=300",
        "data.synthetic.max_words=10", "data.synthetic.long_max_words=14",
        "data.synthetic.valid_size=80", "data.synthetic.test_size=10", "data.synthetic.probe_size=4",
        "data.synthetic.long_size=4", "data.max_tokens=256", "train.max_steps=5", "train.save_every=0",
        "train.valid_every=4", "train.valid_bleu_size=0", "train.progress=false", "train.threads=1",
        "train.diagnostics_every=2", "eval.at_end=false", f"train.run_dir={run_dir}",
    ]))  # fmt: skip
    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    tags = [t for t in events.Tags()["scalars"] if t.startswith("diag/")]
    expected = [f"diag/{s}/layer{layer}/head{h}/mean_distance" for s in ("enc", "dec") for layer in (0, 1)
                for h in range(4)]  # fmt: skip
    assert sorted(tags) == sorted(expected)
    assert [e.step for e in events.Scalars(expected[0])] == [2, 4, 5]
    images = events.Tags()["images"]
    assert sorted(images) == ["diag/dec/position_similarity", "diag/enc/position_similarity"]
    # the images only where a diagnostics step is also a validation step (4), and at the last
    assert [(e.step, e.width, e.height) for e in events.Images(images[0])] == [(s, 48, 48) for s in (4, 5)]

    # tpe-eval --diagnostics on the export of the last step and the validation split: the same batch,
    # so the same figures as the last step's scalars (TensorBoard stores float32)
    _, cfg, tok = load_export(run_dir / "checkpoint")
    valid = corpus_sets(cfg.data, [cfg.data.valid_split])[0]
    argv = ["--checkpoint", str(run_dir / "checkpoint"), "--split", cfg.data.valid_split, "--beam", "1"]
    assert eval_main([*argv, "--diagnostics", "--out", str(tmp_path / "eval"), "--json"]) == 0
    printed = io.StringIO(capsys.readouterr().err)  # --json: the figures on stdout, the table on stderr
    assert eval_main([*argv, "--checkpoint", str(run_dir / "checkpoint"), "--diagnostics"]) == 2
    assert "give one --checkpoint" in capsys.readouterr().err  # an ensemble has no one attention map
    written = json.loads((tmp_path / "eval" / "diagnostics.json").read_text())
    assert written["pairs"] == 64 and written["heads"] == [0, 1, 2, 3]
    for side, short in (("encoder", "enc"), ("decoder", "dec")):
        for layer in (0, 1):
            for h in range(4):
                logged = events.Scalars(f"diag/{short}/layer{layer}/head{h}/mean_distance")[-1].value
                assert abs(written["mean_distance"][side][layer][h] - logged) < 1e-5
        sim = written["position_similarity"][side]
        assert sim["rows"] == 48 and abs(sim["by_offset"][0] - 1.0) < 1e-9  # a row is itself
        assert (tmp_path / "eval" / f"position-similarity-{side}.png").exists()
    with pytest.raises(ValueError, match=r"none of the \d+ pairs given fits data.max_len=2 tokens"):
        diagnostic_batch(tok, valid.pairs, 2)  # bad input: a clear error, before any forward
    table = printed.getvalue().splitlines()
    assert table[0] == "mean attention distance (positions), self-attention, 64 pairs"
    assert table[1].split() == ["side", "layer", "head", "0", "head", "1", "head", "2", "head", "3", "mean"]
    first = table[2].split()
    assert first[:2] == ["encoder", "0"] and float(first[2]) == round(
        written["mean_distance"]["encoder"][0][0], 2
    )
