"""``tpe-ckpt export --format hf``: a transformers model whose logits equal ours (random weights for
every exportable layout; one few-step trained model through the command, loaded back with
``AutoModelForSeq2SeqLM`` and ``AutoTokenizer``), whose tokenizer gives our ids, and whose
``generate`` gives ``tpe-translate``'s translations; and clear refusals for every other model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from support.models import tiny_model
from tokenizers import Tokenizer

from tpe_train.ckpt import hf as hf_export
from tpe_train.ckpt.cli import main
from tpe_train.ckpt.export import load_export, save_export
from tpe_train.ckpt.store import CheckpointError
from tpe_train.config import load_config
from tpe_train.data.batching import EOS_ID, model_args, pad
from tpe_train.data.tokenizer import encode, train_tokenizer
from tpe_train.evaluation.decoding import DecodeOptions, decode_sentences, token_batches
from tpe_train.model.build import build_model

SENTENCES = ["the small cat sees a big dog .", "a man rides", "two dogs play in the snow .", "yes"]
# a small demo model, trained in this process for a few hundred steps (a run directory with one checkpoint)
TINY = [
    "model.d_model=32", "model.n_heads=4", "model.ffn_dim=64", "model.encoder_layers=2",
    "model.decoder_layers=2", "model.dropout=0.0", "data.vocab_size=120", "data.synthetic.train_size=1500",
    "data.synthetic.valid_size=20", "data.synthetic.test_size=40", "data.synthetic.probe_size=10",
    "data.synthetic.long_size=10", "data.synthetic.max_words=10", "data.synthetic.long_max_words=14",
    "data.max_tokens=512", "train.max_steps=200", "train.log_every=1000", "train.valid_every=1000",
    "train.valid_bleu_size=0", "train.progress=false", "train.threads=1", "train.warmup_steps=20",
    "train.lr=5e-3", "eval.at_end=false", "eval.max_tokens=120",
]  # fmt: skip


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_tokenizer([*SENTENCES, "zwei Hunde spielen im Schnee ."] * 20, 60)


def _logits(model: torch.nn.Module, hf: Any, src: torch.Tensor, tgt: torch.Tensor) -> float:
    """Largest difference of teacher-forced logits on a right-padded batch (padding rows excluded)."""
    with torch.no_grad():
        ours = model(src, tgt)
        theirs = hf(input_ids=src, attention_mask=(src != 0).long(), decoder_input_ids=tgt).logits
    keep = tgt != 0
    return float((ours - theirs)[keep].abs().max())


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    src = pad([[5, 6, 7, 8, 9, 10, EOS_ID], [11, 12, EOS_ID], [13, 14, 15, 16, EOS_ID]])
    tgt = pad([[1, 17, 18, 19, 20, 21], [1, 22], [1, 23, 24, 25]])
    return src, tgt


def _random(kind: str, vocab: int, pre_norm: bool) -> torch.nn.Module:
    """A tiny model with random LayerNorm affines and biases too (init leaves them 1 and 0, which
    would hide a LayerNorm or bias left unpermuted)."""
    torch.manual_seed(0)
    model = tiny_model(kind, vocab_size=vocab, pre_norm=pre_norm)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize(
    ("kind", "pre_norm", "arch"),
    [
        ("sinusoidal", False, "MarianMTModel"),
        ("sinusoidal", True, "PegasusForConditionalGeneration"),
        ("learned", True, "BlenderbotForConditionalGeneration"),
        ("none", True, "BlenderbotForConditionalGeneration"),
    ],
)
def test_exported_logits_equal_ours(kind: str, pre_norm: bool, arch: str, tok: Tokenizer) -> None:
    model = _random(kind, tok.get_vocab_size(), pre_norm)
    hf, _ = hf_export.to_hf(model, load_config("demo", []), tok)
    assert type(hf).__name__ == arch
    assert _logits(model, hf, *_batch()) < 1e-4


def test_the_sinusoid_needs_the_permutation(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the residual permutation Marian's table (sines, then cosines) meets our interleaved
    one: the logits are far off, so the test above can fail."""
    model = _random("sinusoidal", tok.get_vocab_size(), False)
    monkeypatch.setattr(hf_export, "residual_permutation", lambda d: torch.arange(d))
    hf, _ = hf_export.to_hf(model, load_config("demo", []), tok)
    assert _logits(model, hf, *_batch()) > 1e-2


@pytest.mark.parametrize(
    ("kind", "changes", "why"),
    [
        ("shaw", {}, "no transformers text encoder-decoder has them"),
        ("t5", {}, "RMSNorm"),
        ("rope", {}, "rotary"),
        ("alibi", {}, "ALiBi"),
        ("learned", {}, "recomputes its sinusoid whenever it is loaded"),
        ("none", {}, "recomputes its sinusoid whenever it is loaded"),
        ("sinusoidal", {"decoder_position": "none"}, "one encoding in both stacks"),
        ("sinusoidal", {"cross_position": "sinusoidal"}, "none in cross-attention"),
    ],
)
def test_models_without_an_exact_transformers_twin_are_refused(kind: str, changes: dict, why: str) -> None:
    model = tiny_model(kind, **changes)
    with pytest.raises(CheckpointError, match=why):
        hf_export.hf_target(model.args)


@pytest.mark.parametrize("beam", [1, 4])
def test_generate_ends_sentences_at_tpe_translates_length_cap(tok: Tokenizer, beam: int) -> None:
    """A random model rarely says EOS: its hypotheses run into the cap (a * source + b), where
    tpe-translate forces EOS per sentence; LengthCap makes generate do the same in a batch of
    sentences with different caps."""
    model = _random("sinusoidal", tok.get_vocab_size(), False)
    hf, _ = hf_export.to_hf(model, load_config("demo", []), tok)
    options = DecodeOptions(beam=beam, alpha=0.0, max_len_a=0.5, max_len_b=3, max_tokens=1000, batch_size=10)
    ours = decode_sentences(model, tok, SENTENCES, options)
    seqs = [[*s, EOS_ID] for s in encode(tok, SENTENCES)]
    hyps = hf_export.generate(hf, seqs, beam, 0.0, options.max_len_a, options.max_len_b)
    limits = hf_export.length_limits([len(s) for s in seqs], 0.5, 3, None)
    assert len(set(limits)) == len(SENTENCES)  # four different caps in one batch
    assert sum(len(h) == cap - 1 for h, cap in zip(hyps, limits, strict=True)) >= 2  # caps were reached
    assert tok.decode_batch(hyps, skip_special_tokens=True) == [t.text for t in ours]
    assert [len(h) for h in hyps] == [t.output_tokens for t in ours]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tpe_train.train.loop import run

    root = tmp_path_factory.mktemp("hf")
    run(load_config("demo", [*TINY, f"train.run_dir={root / 'run'}"]))  # about 3 s
    return root / "run"


@pytest.fixture(scope="module")
def exported(run_dir: Path) -> Path:
    out = run_dir.parent / "hf"
    assert main(["export", str(run_dir), "--out", str(out), "--format", "hf"]) == 0
    return out


@pytest.mark.slow
def test_the_command_exports_a_run_that_auto_classes_load(run_dir: Path, exported: Path) -> None:
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    model, _, tok = load_export(run_dir / "checkpoint")  # the run's final export: the same step
    hf = AutoModelForSeq2SeqLM.from_pretrained(exported)
    hf_tok = AutoTokenizer.from_pretrained(exported)
    assert type(hf).__name__ == "MarianMTModel" and not hf.training
    meta = json.loads((exported / hf_export.PROVENANCE).read_text())
    assert meta["step"] == 200 and meta["encoding"] == "sinusoidal" and meta["source"] == str(run_dir)
    card = (exported / "README.md").read_text()
    assert "MarianMTModel" in card and "training step 200" in card and "AutoTokenizer" in card
    lines = ["the small cat sees a big dog .", "a red bird .", "Ünïcode wörds, and digits 123!"]
    ids = hf_tok(lines).input_ids
    assert ids == [[*seq, EOS_ID] for seq in encode(tok, lines)]
    assert hf_tok.batch_decode(ids, skip_special_tokens=True) == tok.decode_batch(
        ids, skip_special_tokens=True
    )
    batch = hf_tok(
        lines, text_target=["eine kleine Katze .", "ein Vogel", "ja"], return_tensors="pt", padding=True
    )
    tgt_in = hf.prepare_decoder_input_ids_from_labels(batch["labels"])
    assert _logits(model, hf, batch["input_ids"], tgt_in) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("beam", [1, 4])
def test_generate_translates_as_tpe_translate(run_dir: Path, exported: Path, beam: int) -> None:
    """Greedy and beam 4 (no length penalty: alpha 0 is the one value both length penalties share)
    on the run's test sentences, batched as tpe-translate batches them."""
    from transformers import AutoModelForSeq2SeqLM

    from tpe_train.evaluation.evaluate import config_sets

    model, cfg, tok = load_export(run_dir / "checkpoint")
    hf = AutoModelForSeq2SeqLM.from_pretrained(exported)
    sources = [s for s, _ in config_sets(cfg.data)[0].pairs]
    options = DecodeOptions.of(cfg.eval, beam=beam, alpha=0.0)
    ours = [t.text for t in decode_sentences(model, tok, sources, options)]
    seqs = [[*s, EOS_ID] for s in encode(tok, sources)]
    theirs: list[str | None] = [None] * len(sources)
    for batch in token_batches([len(s) for s in seqs], options.max_tokens, options.batch_size):
        hyps = hf_export.generate(
            hf, [seqs[i] for i in batch], beam, 0.0, options.max_len_a, options.max_len_b
        )
        for i, text in zip(batch, tok.decode_batch(hyps, skip_special_tokens=True), strict=True):
            theirs[i] = text
    assert len(sources) == 40 and len(set(ours)) >= 15  # a model that translates, not one line
    assert theirs == ours


def test_the_command_refuses_what_it_cannot_export(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = load_config("demo", ["model.position.kind=shaw", "model.d_model=32", "model.ffn_dim=64"])
    tok = train_tokenizer(SENTENCES * 5, 40)
    model = build_model(model_args(cfg.model, tok.get_vocab_size()))
    src = save_export(tmp_path / "shaw", model, cfg, tok, step=3)
    assert main(["export", str(src), "--out", str(tmp_path / "out"), "--format", "hf"]) == 2
    assert "model.position.kind=shaw cannot be exported to transformers" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert main(["export", str(src), "--out", str(tmp_path / "out"), "--quantization", "int8"]) == 2
    assert "--quantization int8 applies to --format ctranslate2 only" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "o"), "--format", "hf"]) == 2
    assert "does not exist" in capsys.readouterr().err
