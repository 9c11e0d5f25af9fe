"""The CTranslate2 export (``tpe_train.ckpt.ct2``) against our own model, in process, on tiny models:
CTranslate2's teacher-forced log-probabilities equal ours (fp32, within 1e-4) for every encoding and
layout it represents, its greedy and beam outputs equal ``decode_sentences``' on models trained a few
steps, and what it cannot represent or write is refused with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import ctranslate2
import pytest
import torch
from support.models import KINDS, TRAINED, tiny_model
from tokenizers import Tokenizer

from tpe_train.ckpt.ct2 import (
    TABLE_POSITIONS,
    alibi_as_t5,
    best_pieces,
    detokenize,
    export_ctranslate2,
    pieces,
    translate,
)
from tpe_train.ckpt.export import load_export, save_export
from tpe_train.ckpt.store import CheckpointError
from tpe_train.config import Config, load_config
from tpe_train.data.batching import model_args, pad
from tpe_train.data.synthetic import generate
from tpe_train.data.tokenizer import encode, train_tokenizer
from tpe_train.evaluation.decoding import DecodeOptions, decode_sentences
from tpe_train.model.build import build_model
from tpe_train.model.transformer import Transformer
from tpe_train.positions.relative import alibi_slopes, t5_bucket

TRAIN, TEST = 360, 40  # synthetic pairs of at most 45 source characters (about 28 tokens)


@pytest.fixture(scope="module")
def corpus() -> tuple[Tokenizer, list[tuple[str, str]]]:
    pairs = [p for p in generate(2000, seed=1) if len(p[0]) < 45][: TRAIN + TEST]
    tok = train_tokenizer([p[0] for p in pairs] + [p[1] for p in pairs], 150)
    return tok, pairs


@pytest.fixture(scope="module")
def cfg() -> Config:
    return load_config(None, [])


def _export(
    model: Transformer, cfg: Config, tok: Tokenizer, out: Path, q: str = "float32"
) -> ctranslate2.Translator:
    export_ctranslate2(model, cfg, tok, out, q)
    return ctranslate2.Translator(str(out), device="cpu", intra_threads=1)


def _our_log_probs(model: Transformer, tok: Tokenizer, src: list[str], tgt: list[str]) -> list[torch.Tensor]:
    """Teacher-forced log p of each target token and EOS, as the training loss sees them."""
    s = [[*ids, 2] for ids in encode(tok, src)]
    t = encode(tok, tgt)
    with torch.no_grad():
        lp = torch.log_softmax(model(pad(s), pad([[1, *ids] for ids in t])).float(), dim=-1)
    return [lp[i, torch.arange(len(ids) + 1), [*ids, 2]] for i, ids in enumerate(t)]


VARIANTS = [
    *[(kind, {}) for kind in TRAINED],
    ("sinusoidal", {"pre_norm": True}),
    ("rope", {"pre_norm": True}),
    ("shaw", {"shaw_values": True}),
    ("alibi", {"encoder_position": "none"}),  # ALiBi in the decoder only: CTranslate2's own
    ("t5", {"decoder_position": "rope"}),
]


@pytest.mark.parametrize(
    ("kind", "changes"), VARIANTS, ids=[f"{k}{'-' if c else ''}{'-'.join(c)}" for k, c in VARIANTS]
)
def test_scores_equal_our_teacher_forced_log_probs(
    kind: str,
    changes: dict[str, object],
    corpus: tuple[Tokenizer, list[tuple[str, str]]],
    cfg: Config,
    tmp_path: Path,
) -> None:
    tok, pairs = corpus
    model = tiny_model(kind, vocab_size=tok.get_vocab_size(), **changes)
    with torch.no_grad():  # relative values start at zero: give them weight, or the test sees none
        for module in model.modules():
            if isinstance(getattr(module, "values", None), torch.nn.Parameter):
                module.values.normal_()
    src, tgt = [p[0] for p in pairs[-TEST:]], [p[1] for p in pairs[-TEST:]]
    translator = _export(model, cfg, tok, tmp_path / "ct2")
    theirs = translator.score_batch(pieces(tok, src), pieces(tok, tgt))
    ours = _our_log_probs(model, tok, src, tgt)
    worst = max(float((o - torch.tensor(r.log_probs)).abs().max()) for o, r in zip(ours, theirs, strict=True))
    assert all(len(r.tokens) == len(o) for o, r in zip(ours, theirs, strict=True))  # target pieces + </s>
    assert worst < 1e-4, f"{kind} {changes}: log-probabilities differ by up to {worst:.2e}"


_TRAINED: dict[str, Transformer] = {}


def _trained(kind: str, tok: Tokenizer, pairs: list[tuple[str, str]]) -> Transformer:
    """A tiny model of ``kind`` after 40 Adam steps on the synthetic pairs: enough for its hypotheses to
    end with EOS before the length limit (random weights run to it, where the searches differ)."""
    if kind not in _TRAINED:
        torch.manual_seed(0)
        model = tiny_model(kind, vocab_size=tok.get_vocab_size())
        model.train()
        src = [[*ids, 2] for ids in encode(tok, [p[0] for p in pairs[:TRAIN]])]
        tgt = encode(tok, [p[1] for p in pairs[:TRAIN]])
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(0)
        for _ in range(40):
            rows = torch.randint(0, TRAIN, (32,), generator=gen).tolist()
            logits = model(pad([src[i] for i in rows]), pad([[1, *tgt[i]] for i in rows]))
            gold = pad([[*tgt[i], 2] for i in rows])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), gold.flatten(), ignore_index=0)
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        _TRAINED[kind] = model
    return _TRAINED[kind]


@pytest.mark.slow
@pytest.mark.parametrize("kind", TRAINED)
def test_greedy_and_beam_outputs_equal_ours(
    kind: str, corpus: tuple[Tokenizer, list[tuple[str, str]]], cfg: Config, tmp_path: Path
) -> None:
    tok, pairs = corpus
    model = _trained(kind, tok, pairs)
    src = [p[0] for p in pairs[-TEST:]]
    translator = _export(model, cfg, tok, tmp_path / "ct2")
    cap = model.max_target_length()
    greedy = DecodeOptions(1, 0.6, 1.0, 50, 6000, 128)
    ours = [t.text for t in decode_sentences(model, tok, src, greedy)]
    assert translate(translator, tok, src, beam=1, max_target_positions=cap) == ours

    beam = DecodeOptions(4, 0.6, 1.0, 50, 6000, 128)
    found = decode_sentences(model, tok, src, beam)
    best = best_pieces(translator, tok, src, beam=4, alpha=0.6, max_target_positions=cap)
    theirs = detokenize(tok, best)
    limit = [min(t.source_tokens + 1 + 50, cap or 10**9) - 1 for t in found]  # tokens before a forced EOS
    ended = [i for i, t in enumerate(found) if t.output_tokens < limit[i]]
    assert len(ended) >= 35, f"{kind}: only {len(ended)} of {TEST} hypotheses ended before the length limit"
    assert [theirs[i] for i in ended] == [found[i].text for i in ended]
    assert len({found[i].text for i in ended}) >= 3  # not one degenerate output for every sentence
    assert not any("<pad>" in hyp for hyp in best)


def test_an_export_read_back_exports_and_writes_its_files(
    corpus: tuple[Tokenizer, list[tuple[str, str]]], cfg: Config, tmp_path: Path
) -> None:
    tok, pairs = corpus
    shape = ["model.d_model=32", "model.n_heads=4", "model.ffn_dim=64", "model.encoder_layers=2"]
    small = load_config(None, [*shape, "model.decoder_layers=2"])
    built = build_model(model_args(small.model, tok.get_vocab_size()))
    save_export(tmp_path / "export", built, small, tok, 1)
    model, read_cfg, read_tok = load_export(tmp_path / "export")
    out = tmp_path / "ct2"
    export_ctranslate2(model, read_cfg, read_tok, out, "int8")
    vocabulary = json.loads((out / "shared_vocabulary.json").read_text())
    assert vocabulary == [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    config = json.loads((out / "config.json").read_text())
    assert config["add_source_eos"] and config["decoder_start_token"] == "<s>"
    assert config["layer_norm_epsilon"] == pytest.approx(1e-5)
    assert Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab() == tok.get_vocab()
    assert "translate_batch" in (out / "README.md").read_text()
    # int8: one byte instead of four per matrix weight (the embedding is stored once), and
    # log-probabilities near ours
    fp32 = tmp_path / "fp32"
    export_ctranslate2(model, read_cfg, read_tok, fp32, "float32")
    matrices = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "positions" not in n)
    saved = (fp32 / "model.bin").stat().st_size - (out / "model.bin").stat().st_size
    assert 2.5 * matrices < saved <= 3 * matrices
    src, tgt = [p[0] for p in pairs[-8:]], [p[1] for p in pairs[-8:]]
    int8 = ctranslate2.Translator(str(out), intra_threads=1).score_batch(pieces(tok, src), pieces(tok, tgt))
    ours = _our_log_probs(model, tok, src, tgt)
    worst = max(float((o - torch.tensor(r.log_probs)).abs().max()) for o, r in zip(ours, int8, strict=True))
    assert 0 < worst < 0.3


def test_the_encoders_alibi_is_exact_in_t5_buckets_below_the_table() -> None:
    heads = 4
    table, max_distance = alibi_as_t5(heads)
    d = torch.arange(-TABLE_POSITIONS + 1, TABLE_POSITIONS)  # key minus query
    buckets = t5_bucket(d, True, table.shape[0], max_distance)
    slopes = torch.tensor(alibi_slopes(heads))
    assert torch.equal(torch.from_numpy(table)[buckets], -slopes[None, :] * d.abs().float()[:, None])
    far = t5_bucket(torch.tensor([TABLE_POSITIONS, 3 * TABLE_POSITIONS]), True, table.shape[0], max_distance)
    assert (torch.from_numpy(table)[far] >= -slopes * 2 * TABLE_POSITIONS).all()  # log buckets: no wilder


def test_what_cannot_be_written_is_refused_with_the_reason(
    corpus: tuple[Tokenizer, list[tuple[str, str]]], cfg: Config, tmp_path: Path
) -> None:
    tok, _ = corpus
    vocab = tok.get_vocab_size()
    cross = tiny_model("none", vocab_size=vocab, cross_position="rope")
    with pytest.raises(
        CheckpointError, match=r"cross=rope cannot be exported to CTranslate2: its encoder-decoder"
    ):
        export_ctranslate2(cross, cfg, tok, tmp_path / "a", "float32")
    model = tiny_model("sinusoidal", vocab_size=vocab)
    with pytest.raises(
        CheckpointError, match=r"quantization 'int4' .* choose one of float32, int8, int8_float16"
    ):
        export_ctranslate2(model, cfg, tok, tmp_path / "b", "int4")
    with pytest.raises(CheckpointError, match=r"tokenizer has \d+ tokens but the model's embedding 40 rows"):
        export_ctranslate2(tiny_model("sinusoidal"), cfg, tok, tmp_path / "c", "float32")
    assert not any(tmp_path.iterdir())  # refused before anything was written


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in TRAINED])
def test_encodings_without_a_ct2_form_are_refused_with_the_reason(
    kind: str, corpus: tuple[Tokenizer, list[tuple[str, str]]], cfg: Config, tmp_path: Path
) -> None:
    tok, _ = corpus
    model = tiny_model(kind, vocab_size=tok.get_vocab_size(), encoder_position="sinusoidal")
    with pytest.raises(CheckpointError, match=rf"decoder's position encoding '{kind}' cannot be exported"):
        export_ctranslate2(model, cfg, tok, tmp_path / "out", "float32")
    assert not any(tmp_path.iterdir())
