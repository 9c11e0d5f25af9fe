"""The ``data`` config, read once: the plain specs the preparation pipeline's stages take, and the token
store's place, keyed by a fingerprint of every setting that shapes the stored tokens.

``data/prepare.py`` turns the config into a ``PipelineSpec`` once and hands each stage its own part; no
stage module imports the config (tests/test_data_pipeline.py checks it).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from tpe_train.config import CleanConfig, DataConfig, SyntheticConfig
from tpe_train.data.clean import CleanSpec
from tpe_train.data.sources import SourceSpec
from tpe_train.data.store import STORE_VERSION
from tpe_train.data.tokenise import TokenizerSpec

DEFAULT_ROOT = "~/.cache/tpe-train/data"


@dataclass(frozen=True, kw_only=True)
class CorpusSpec:
    """Which corpus and which of its splits."""

    kind: str  # synthetic | hub | parquet | disk | text
    source: SourceSpec  # where a real corpus lives
    synthetic: SyntheticConfig  # the generator's section (the synthetic corpus)
    train_split: str
    valid_split: str
    test_split: str

    @property
    def valid_where(self) -> str:
        """The validation split as messages name it (a text corpus: with its two files)."""
        where = f"the validation split data.valid_split={self.valid_split!r}"
        if self.kind == "text":
            s = self.source
            where += f" ({s.path}/{self.valid_split}.{s.src_lang} and .{s.tgt_lang})"
        return where


@dataclass(frozen=True, kw_only=True)
class PipelineSpec:
    """Everything preparation needs, stage by stage: read (``corpus``), clean, de-duplicate, tokenise
    (``tokenizer``, ``max_len``), store (``store``)."""

    corpus: CorpusSpec
    clean: CleanSpec
    dedup: bool
    tokenizer: TokenizerSpec
    max_len: int
    num_proc: int  # processes for cleaning and tokenising
    streaming: bool
    store: Path


def source_spec(cfg: DataConfig) -> SourceSpec:
    """Where the ``data`` section's real corpus lives."""
    return SourceSpec(
        kind=cfg.corpus,
        src_lang=cfg.src_lang,
        tgt_lang=cfg.tgt_lang,
        path=cfg.path,
        hub_id=cfg.hub_id,
        hub_config=cfg.hub_config,
        cache_dir=cfg.cache_dir,
        bad_utf8=cfg.bad_utf8,
    )


def corpus_spec(cfg: DataConfig) -> CorpusSpec:
    """The ``data`` section's corpus and split names."""
    return CorpusSpec(
        kind=cfg.corpus,
        source=source_spec(cfg),
        synthetic=cfg.synthetic,
        train_split=cfg.train_split,
        valid_split=cfg.valid_split,
        test_split=cfg.test_split,
    )


def clean_spec(c: CleanConfig) -> CleanSpec:
    """The cleaning the ``data.clean`` section asks for (de-duplication is a stage of its own)."""
    return CleanSpec(
        normalize=c.normalize, min_words=c.min_words, max_words=c.max_words, max_ratio=c.max_ratio
    )


def pipeline_spec(cfg: DataConfig) -> PipelineSpec:
    """The whole ``data`` section as the pipeline's specs."""
    return PipelineSpec(
        corpus=corpus_spec(cfg),
        clean=clean_spec(cfg.clean),
        dedup=cfg.clean.dedup,
        tokenizer=TokenizerSpec(kind=cfg.tokenizer, vocab_size=cfg.vocab_size, sample=cfg.tokenizer_sample),
        max_len=cfg.max_len,
        num_proc=cfg.num_proc,
        streaming=cfg.streaming,
        store=store_path(cfg),
    )


def fingerprint(cfg: DataConfig) -> str:
    """A short hash of every data setting that changes the stored tokens."""
    fields = cfg.model_dump(mode="json", exclude={"max_tokens", "num_proc", "store_dir", "shuffle_buffer"})
    if cfg.corpus != "synthetic":
        fields.pop("synthetic")
    fields["version"] = STORE_VERSION
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def store_path(cfg: DataConfig) -> Path:
    """``<data.store_dir or $TPE_DATA_CACHE or ~/.cache/tpe-train/data>/<corpus>-<fingerprint>``."""
    root = cfg.store_dir or os.environ.get("TPE_DATA_CACHE", DEFAULT_ROOT)
    return Path(root).expanduser() / f"{cfg.corpus}-{fingerprint(cfg)}"
