"""The study's presets: every one loads and validates with every encoding, and holds the published setup."""

from __future__ import annotations

import pytest

from tpe_train.config import PRESET_DIR, ConfigError, load_config
from tpe_train.parallel.batch import estimated_micro_tokens, resolve
from tpe_train.positions import POSITIONS

STUDY_PRESETS = [
    "wmt14_en_de_base",
    "wmt14_en_de_big",
    "wmt14_en_fr_big",
    "multi30k_en_de",
    "multi30k_en_de_cpu",
]
PAPER_RANKS = 8  # Vaswani et al. trained on 8 GPUs; the presets' batch is per rank


@pytest.mark.parametrize("preset", STUDY_PRESETS)
def test_preset_validates_with_every_encoding_by_one_override(preset: str) -> None:
    assert (PRESET_DIR / f"{preset}.yaml").is_file()
    for kind in POSITIONS.names():
        cfg = load_config(preset, [f"model.position.kind={kind}"])
        assert cfg.model.position.kind == kind
        assert cfg.preset == preset
        # what the run will build: the encoding in encoder and decoder self-attention
        args = cfg.model.args(vocab_size=cfg.data.vocab_size, pad_id=0, bos_id=1, eos_id=2)
        assert args.encoder_position == kind and args.decoder_position == kind


@pytest.mark.parametrize("preset", STUDY_PRESETS)
def test_no_positions_in_encoder_or_decoder_only(preset: str) -> None:
    cfg = load_config(preset, ["model.position.kind=rope", "model.position.encoder=false"])
    args = cfg.model.args(vocab_size=100, pad_id=0, bos_id=1, eos_id=2)
    assert (args.encoder_position, args.decoder_position) == ("none", "rope")
    cfg = load_config(preset, ["model.position.kind=rope", "model.position.decoder=false"])
    args = cfg.model.args(vocab_size=100, pad_id=0, bos_id=1, eos_id=2)
    assert (args.encoder_position, args.decoder_position) == ("rope", "none")


def _tokens_per_step(preset: str) -> float:
    """Source + target tokens of a step on the paper's 8 ranks (target tokens resolved as the trainer
    does, with the launcher's estimate of a micro-batch; the source side about as many)."""
    cfg = load_config(preset)
    assert cfg.train.batch_tokens == 25_000
    micro = estimated_micro_tokens(cfg.data.max_tokens)
    return 2 * resolve(cfg.train.batch_tokens, cfg.data.max_tokens, micro, PAPER_RANKS).global_tokens


def test_wmt14_en_de_base_is_the_papers_base_model() -> None:
    cfg = load_config("wmt14_en_de_base")
    m, t, d, e = cfg.model, cfg.train, cfg.data, cfg.eval
    assert (m.d_model, m.n_heads, m.ffn_dim, m.encoder_layers, m.decoder_layers) == (512, 8, 2048, 6, 6)
    assert m.dropout == 0.1 and not m.pre_norm and m.position.kind == "sinusoidal"
    assert t.label_smoothing == 0.1 and t.warmup_steps == 4000 and t.adam_betas == (0.9, 0.98)
    assert t.max_steps == 100_000
    assert t.lr == pytest.approx(512**-0.5 * 4000**-0.5, rel=1e-3)  # the peak of the paper's schedule
    assert (d.corpus, d.hub_id, d.hub_config) == ("hub", "wmt/wmt14", "de-en")
    assert (d.src_lang, d.tgt_lang) == ("en", "de")
    assert d.tokenizer == "bpe" and d.vocab_size == 37000
    # about 25,000 source + 25,000 target tokens per step (train.batch_tokens: the target side)
    assert 0.9 * 50_000 <= _tokens_per_step("wmt14_en_de_base") <= 1.1 * 50_000
    assert (e.beam, e.alpha, e.max_len_a, e.max_len_b) == (4, 0.6, 1.0, 50)
    # the final model is the mean of the last 5 checkpoints, which are kept
    assert e.average_last == 5 and t.keep_last >= 5 and t.save_every > 0 and 5 * t.save_every <= t.max_steps


def test_wmt14_big_presets_are_the_papers_big_models() -> None:
    de = load_config("wmt14_en_de_big")
    fr = load_config("wmt14_en_fr_big")
    for cfg in (de, fr):
        m, t = cfg.model, cfg.train
        assert (m.d_model, m.n_heads, m.ffn_dim, m.encoder_layers, m.decoder_layers) == (1024, 16, 4096, 6, 6)
        assert t.max_steps == 300_000 and t.warmup_steps == 4000 and t.label_smoothing == 0.1
        assert t.adam_betas == (0.9, 0.98)
        assert t.lr == pytest.approx(1024**-0.5 * 4000**-0.5, rel=1e-3)
        assert cfg.eval.average_last == 20 and t.keep_last >= 20 and 20 * t.save_every <= t.max_steps
        assert (cfg.eval.beam, cfg.eval.alpha) == (4, 0.6)
        assert 0.9 * 50_000 <= _tokens_per_step(cfg.preset) <= 1.1 * 50_000
    assert de.model.dropout == 0.3 and de.data.vocab_size == 37000 and de.data.tgt_lang == "de"
    # En-Fr big: dropout 0.1 instead of 0.3, 32,000 shared vocabulary, the fr-en corpus
    assert fr.model.dropout == 0.1 and fr.data.vocab_size == 32000
    assert (fr.data.hub_config, fr.data.src_lang, fr.data.tgt_lang) == ("fr-en", "en", "fr")


def test_multi30k_path_comes_from_the_environment_or_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MULTI30K", raising=False)
    assert load_config("multi30k_en_de").data.path == "../shared/data/multi30k"
    monkeypatch.setenv("MULTI30K", "/data/multi30k")
    assert load_config("multi30k_en_de").data.path == "/data/multi30k"
    assert load_config("multi30k_en_de_cpu").data.path == "/data/multi30k"  # through base:
    assert load_config("multi30k_en_de", ["data.path=/x"]).data.path == "/x"  # an override still wins
    monkeypatch.delenv("MULTI30K")
    with pytest.raises(ConfigError, match=r"cannot resolve an interpolation.*NO_SUCH_VARIABLE_TPE"):
        load_config("demo", ["data.path=${oc.env:NO_SUCH_VARIABLE_TPE}"])


def test_multi30k_reads_text_files_from_a_path_given_by_override() -> None:
    cfg = load_config("multi30k_en_de")
    d = cfg.data
    assert d.corpus == "text" and d.path  # a default path; loading the config reads no data
    assert (d.src_lang, d.tgt_lang) == ("en", "de")
    assert (d.train_split, d.valid_split, d.test_split) == ("train", "val", "test_2016_flickr")
    assert cfg.model.d_model <= 512 and cfg.model.encoder_layers <= 6  # sized for one machine
    moved = load_config("multi30k_en_de", ["data.path=/somewhere/else/multi30k"])
    assert moved.data.path == "/somewhere/else/multi30k"
    assert cfg.eval.length_buckets == sorted(cfg.eval.length_buckets)
