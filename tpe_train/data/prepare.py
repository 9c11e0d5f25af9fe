"""Preparation, the one orchestrator of the data pipeline. The ``data`` config is read once
(data/specs.py); a real corpus then passes through five stages, once each, in this order:

    read (sources.py, textfiles.py) -> clean (clean.py) -> de-duplicate (dedup.py)
        -> tokenise (tokenise.py) -> store (store.py)

Each stage takes plain values and its own spec, returns its result here, and calls no other stage;
none imports the config (tests/test_data_pipeline.py checks both). A store whose fingerprint matches
is reused (data/store_open.py) and no stage runs; the synthetic corpus is generated (data/splits.py)
instead of read, cleaned and de-duplicated; a streamed corpus stores only the tokenizer and the
validation set.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from datasets import Dataset
from tokenizers import Tokenizer

from tpe_train.config import DataConfig
from tpe_train.data.clean import CleanSpec, clean
from tpe_train.data.dedup import first_of_each
from tpe_train.data.errors import CorpusError
from tpe_train.data.lengths import fits
from tpe_train.data.scratch import drop_scratch, made_files
from tpe_train.data.sources import load_split
from tpe_train.data.specs import PipelineSpec, pipeline_spec
from tpe_train.data.splits import Splits, pairs_dataset, pairs_of, synthetic_splits, test_splits, train_stream
from tpe_train.data.store import write_store
from tpe_train.data.store_open import load_store, store_lock
from tpe_train.data.tokenise import drop_too_long, learn_tokenizer, to_dataset
from tpe_train.data.tokenizer import load_tokenizer, vocab_hash

STRIP = CleanSpec(normalize="none", min_words=1, max_words=10**9, max_ratio=0.0)  # valid and test


@dataclass
class Prepared:
    """What training needs: the splits, the tokenizer, tokenised train and valid sets."""

    splits: Splits
    tokenizer: Tokenizer
    train: Dataset
    valid: Dataset
    dropped_too_long: int
    store: Path
    built: bool  # False: an existing store was reused


def prepare(cfg: DataConfig, run_tokenizer: Path | None = None) -> Prepared:
    """The token store of this data config: reused when its fingerprint matches, else built (read or
    generate, clean, de-duplicate, train the joint tokenizer, tokenise, filter by length, store).
    With ``run_tokenizer``, the store's tokenizer is copied there, or checked against the one a run
    directory already holds (a resumed run must keep its vocabulary)."""
    spec = pipeline_spec(cfg)  # the one read of the config
    prepared = _reuse(spec)
    if prepared is None:
        with store_lock(spec.store):  # another process may be building it: wait, then reuse its store
            prepared = _reuse(spec) or _build(spec)
    if run_tokenizer is not None:
        _check_or_copy_tokenizer(prepared.tokenizer, run_tokenizer)
    return prepared


def _reuse(spec: PipelineSpec) -> Prepared | None:
    stored = load_store(spec.store)
    if stored is None:
        return None
    tok, train, valid, meta = stored
    splits = test_splits(spec.corpus)
    splits.valid = valid
    splits.report = meta.get("report", [])
    return Prepared(splits, tok, train, valid, meta["dropped_too_long"], spec.store, built=False)


def _build(spec: PipelineSpec) -> Prepared:
    if spec.streaming:
        return _build_streaming(spec)
    corpus = spec.corpus
    splits = synthetic_splits(corpus.synthetic) if corpus.kind == "synthetic" else _read_clean_dedup(spec)
    tok = learn_tokenizer(splits.train, spec.tokenizer)
    valid = to_dataset(splits.valid, tok)
    check_valid(valid, corpus.valid_where, spec.max_len)  # before the long work on the training split
    tokenized = to_dataset(splits.train, tok, spec.num_proc if spec.num_proc > 1 else None, text=False)
    train, dropped = drop_too_long(tokenized, spec.max_len)
    write_store(spec.store, tok, train, valid, {"dropped_too_long": dropped, "report": splits.report})
    scratch = splits.scratch | made_files(tokenized, train, valid)
    stored = load_store(spec.store)  # read back memory-mapped, as every later run will
    assert stored is not None
    _, train, valid, _ = stored
    splits.train, splits.valid = pairs_dataset([]), valid  # nothing reads the training text any more
    drop_scratch(scratch)
    return Prepared(splits, tok, train, valid, dropped, spec.store, built=True)


def _read_clean_dedup(spec: PipelineSpec) -> Splits:
    """A real corpus read, cleaned and de-duplicated. Every split is read first (so that a missing one
    fails before any long work); the training split is cleaned and its report kept; valid and test
    are only stripped, so that scores are on the references as published."""
    corpus = spec.corpus
    train = loaded_train = load_split(corpus.source, corpus.train_split)
    valid = loaded_valid = load_split(corpus.source, corpus.valid_split)
    test = load_split(corpus.source, corpus.test_split)
    valid, _ = clean(valid, STRIP)
    if len(valid) == 0:
        check_valid(valid, corpus.valid_where, spec.max_len)  # stops here, before cleaning and BPE
    before = len(train)
    cleaned, dropped = clean(train, spec.clean, num_proc=spec.num_proc)
    train, duplicates = first_of_each(cleaned) if spec.dedup else (cleaned, 0)
    report = [format_report(corpus.train_split, before, {**dropped, "duplicate": duplicates})]
    if len(train) == 0:
        raise CorpusError(
            f"no training pair is left after cleaning ({report[0]}); relax data.clean.* or check "
            f"that data.src_lang / data.tgt_lang name the right sides"
        )
    scratch = made_files(loaded_train, loaded_valid, test, cleaned, train, valid)
    return Splits(train, valid, pairs_of(test), report=report, scratch=scratch)


def _build_streaming(spec: PipelineSpec) -> Prepared:
    """Streaming: the store holds the tokenizer (trained on the stream's first pairs) and the
    validation set; training pairs are read, cleaned and tokenised on the fly."""
    corpus = spec.corpus
    splits = test_splits(corpus)
    if corpus.kind != "synthetic":
        splits.valid = load_split(corpus.source, corpus.valid_split)
    first = list(train_stream(corpus, spec.clean).take(spec.tokenizer.sample))
    tok = learn_tokenizer(Dataset.from_list(first), spec.tokenizer)
    empty = to_dataset(pairs_dataset([]), tok)
    valid = to_dataset(splits.valid, tok)
    check_valid(valid, corpus.valid_where, spec.max_len)
    write_store(spec.store, tok, empty, valid, {"dropped_too_long": 0, "report": []})
    splits.valid = valid
    return Prepared(splits, tok, empty, valid, 0, spec.store, built=True)


def format_report(split: str, before: int, dropped: dict[str, int]) -> str:
    """One line: kept pairs and the count dropped for each reason."""
    kept = before - sum(dropped.values())
    parts = ", ".join(f"{reason} {n}" for reason, n in dropped.items() if n)
    return f"{split}: {kept} of {before} pairs kept" + (f" (dropped: {parts})" if parts else "")


def check_valid(valid: Dataset, where: str, max_len: int) -> None:
    """Refuse, before training, a validation set that the first validation could not use: an empty
    one, or one where no pair fits data.max_len (``valid`` tokenised: ``src_len``/``tgt_len``).
    ``where`` names the split (``CorpusSpec.valid_where``)."""
    if len(valid) == 0:
        raise CorpusError(
            f"{where} has no pairs; validation needs at least one: point data.valid_split at a "
            "non-empty split (a text corpus: <split>.<lang> files with lines on both sides)"
        )
    lengths = valid.with_format("numpy")
    if not fits(np.asarray(lengths["src_len"]), np.asarray(lengths["tgt_len"]), max_len).any():
        raise CorpusError(
            f"no pair of {where} fits data.max_len={max_len} tokens on both sides, so validation "
            "would have nothing to score; raise data.max_len or use a validation set of shorter sentences"
        )


def _check_or_copy_tokenizer(tok: Tokenizer, path: Path) -> None:
    if path.exists():
        if vocab_hash(load_tokenizer(path)) != vocab_hash(tok):
            raise CorpusError(
                f"{path} differs from the tokenizer of the prepared data (another vocabulary); a run "
                "directory keeps one vocabulary: use a new train.run_dir, or restore the data settings "
                "the run was started with"
            )
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tok.save(str(tmp))
    tmp.replace(path)
