"""Corpus splits as `datasets` Datasets, tokenised with the joint vocabulary, and collation."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from datasets import Dataset, Features, IterableDataset, Sequence, Value
from tokenizers import Tokenizer

from tpe_train.data import synthetic
from tpe_train.data.batching import EOS_ID, Batch, BatchIterator, BatchState, collate, length_arrays
from tpe_train.data.clean import CleanSpec, clean, clean_spec, clean_stream, format_report
from tpe_train.data.lengths import fits
from tpe_train.data.sources import CorpusError, load_split, source_spec, stream_split
from tpe_train.data.store import load_store, store_lock, store_path, write_store
from tpe_train.data.streaming import StreamingBatches
from tpe_train.data.tokenizer import encode, load_tokenizer, train_tokenizer, vocab_hash

if TYPE_CHECKING:
    from tpe_train.config import DataConfig


@dataclass
class Splits:
    """The corpus: train and valid as src/tgt Datasets; test, long and probe as text pairs.

    ``long`` holds sentences longer than any in training (length extrapolation) and ``probe`` holds
    word-order minimal pairs as consecutive rows (2i, 2i+1); both exist for the synthetic corpus only.
    """

    train: Dataset
    valid: Dataset
    test: list[synthetic.Pair]
    long: list[synthetic.Pair] = field(default_factory=list)
    probe: list[synthetic.Pair] = field(default_factory=list)
    pretokenized: bool = False  # text is already split into words (the synthetic corpus)
    report: list[str] = field(default_factory=list)  # cleaning report lines
    scratch: set[str] = field(default_factory=set)  # datasets cache files made on the way (see _drop_scratch)


def _pairs_dataset(pairs: list[synthetic.Pair]) -> Dataset:
    return Dataset.from_dict({"src": [p[0] for p in pairs], "tgt": [p[1] for p in pairs]})


def pairs_of(ds: Dataset, limit: int | None = None) -> list[synthetic.Pair]:
    """The first ``limit`` (all) rows of a src/tgt Dataset as text pairs."""
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    return list(zip(ds["src"], ds["tgt"], strict=True))


def _synthetic_train(cfg: DataConfig) -> list[synthetic.Pair]:
    s = cfg.synthetic
    return synthetic.generate(s.train_size, s.seed, s.min_words, s.max_words)


def synthetic_splits(cfg: DataConfig) -> Splits:
    """All splits of the embedded corpus; disjoint sources, a pure function of the config."""
    s = cfg.synthetic
    train = _synthetic_train(cfg)
    seen = {src for src, _ in train}
    valid = synthetic.generate(s.valid_size, s.seed + 1, s.min_words, s.max_words, exclude=seen)
    seen |= {src for src, _ in valid}
    test = synthetic.generate(s.test_size, s.seed + 2, s.min_words, s.max_words, exclude=seen)
    seen |= {src for src, _ in test}
    long = (
        synthetic.generate(s.long_size, s.seed + 3, s.max_words + 1, s.long_max_words) if s.long_size else []
    )
    probes = synthetic.minimal_pairs(s.probe_size, s.seed + 4, s.probe_max_words, exclude=seen)
    probe = [pair for minimal in probes for pair in minimal]
    return Splits(_pairs_dataset(train), _pairs_dataset(valid), test, long, probe, pretokenized=True)


def corpus_splits(cfg: DataConfig) -> Splits:
    """The configured corpus. Real corpora: every split is loaded (so a missing one fails before
    any long work), the training split is cleaned and its report kept; valid and test are only
    stripped, so that scores are on the references as published."""
    if cfg.corpus == "synthetic":
        return synthetic_splits(cfg)
    spec = source_spec(cfg)
    train = loaded_train = load_split(spec, cfg.train_split)
    valid = loaded_valid = load_split(spec, cfg.valid_split)
    test = load_split(spec, cfg.test_split)
    strip = CleanSpec(normalize="none", min_words=1, max_words=10**9, max_ratio=0.0)
    valid, _ = clean(valid, strip)
    if len(valid) == 0:
        check_valid(valid, cfg)  # an empty validation set stops here, before cleaning and BPE
    before = len(train)
    train, dropped = clean(train, clean_spec(cfg.clean), num_proc=cfg.num_proc)
    report = [format_report(cfg.train_split, before, dropped)]
    if len(train) == 0:
        raise CorpusError(
            f"no training pair is left after cleaning ({report[0]}); relax data.clean.* or check "
            f"that data.src_lang / data.tgt_lang name the right sides"
        )
    scratch = made_files(loaded_train, loaded_valid, test)
    return Splits(train, valid, pairs_of(test), report=report, scratch=scratch | made_files(train, valid))


def test_splits(cfg: DataConfig) -> Splits:
    """Only what evaluation reads: test (and, synthetic, long and probe) sets."""
    if cfg.corpus == "synthetic":
        return synthetic_splits(cfg)
    empty = _pairs_dataset([])
    return Splits(empty, empty, pairs_of(load_split(source_spec(cfg), cfg.test_split)))


def token_features(vocab_size: int, text: bool) -> Features:
    """The stored columns: token ids as uint16 when the vocabulary fits in 16 bits (every preset's
    does: 37,000 for WMT), else int32; lengths int32; ``text``: the src/tgt strings too. At 4.5M WMT
    pairs int64 ids and the training text made a 3.9 GB store; training reads neither the text nor
    more than 16 bits of an id (benchmarks/bench_wmt_scale.py)."""
    ids = Value("uint16" if vocab_size <= 2**16 else "int32")
    columns = {"src": Value("string"), "tgt": Value("string")} if text else {}
    columns |= {"id": Value("int64"), "src_ids": Sequence(ids), "tgt_ids": Sequence(ids)}
    return Features({**columns, "src_len": Value("int32"), "tgt_len": Value("int32")})


def to_dataset(ds: Dataset, tok: Tokenizer, num_proc: int | None = None, text: bool = True) -> Dataset:
    """Add id, src_ids (+EOS), tgt_ids (+EOS), src_len, tgt_len to a src/tgt Dataset (``text``: keep
    the src/tgt strings; the training split drops them)."""

    def tokenize(batch: dict[str, list[str]], idx: list[int]) -> dict[str, list[list[int]] | list[int]]:
        src = [[*ids, EOS_ID] for ids in encode(tok, batch["src"])]
        tgt = [[*ids, EOS_ID] for ids in encode(tok, batch["tgt"])]
        return {
            "id": idx,
            "src_ids": src,
            "tgt_ids": tgt,
            "src_len": [len(x) for x in src],
            "tgt_len": [len(x) for x in tgt],
        }

    return ds.map(
        tokenize,
        batched=True,
        batch_size=2000,
        with_indices=True,
        num_proc=num_proc,
        features=token_features(tok.get_vocab_size(), text),
        remove_columns=None if text else ["src", "tgt"],
    )


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
    """The token store of this data config: reused when its fingerprint matches, else built
    (load or generate, clean, train the joint tokenizer, tokenise, filter by length) and saved.
    With ``run_tokenizer``, the store's tokenizer is copied there, or checked against the one a
    run directory already holds (a resumed run must keep its vocabulary)."""
    path = store_path(cfg)
    prepared = _reuse(cfg, path)
    if prepared is None:
        with store_lock(path):  # another process may be building it: wait, then reuse its store
            prepared = _reuse(cfg, path) or _build(cfg, path)
    if run_tokenizer is not None:
        _check_or_copy_tokenizer(prepared.tokenizer, run_tokenizer)
    return prepared


def _reuse(cfg: DataConfig, path: Path) -> Prepared | None:
    stored = load_store(path)
    if stored is None:
        return None
    tok, train, valid, meta = stored
    splits = synthetic_splits(cfg) if cfg.corpus == "synthetic" else test_splits(cfg)
    splits.valid = valid
    splits.report = meta.get("report", [])
    return Prepared(splits, tok, train, valid, meta["dropped_too_long"], path, built=False)


def check_valid(valid: Dataset, cfg: DataConfig) -> None:
    """Refuse, before training, a validation set that the first validation could not use: an empty
    one, or one where no pair fits data.max_len (``valid`` tokenised: ``src_len``/``tgt_len``)."""
    where = f"the validation split data.valid_split={cfg.valid_split!r}"
    if cfg.corpus == "text":
        where += f" ({cfg.path}/{cfg.valid_split}.{cfg.src_lang} and .{cfg.tgt_lang})"
    if len(valid) == 0:
        raise CorpusError(
            f"{where} has no pairs; validation needs at least one: point data.valid_split at a "
            "non-empty split (a text corpus: <split>.<lang> files with lines on both sides)"
        )
    lengths = valid.with_format("numpy")
    if not fits(np.asarray(lengths["src_len"]), np.asarray(lengths["tgt_len"]), cfg.max_len).any():
        raise CorpusError(
            f"no pair of {where} fits data.max_len={cfg.max_len} tokens on both sides, so validation "
            "would have nothing to score; raise data.max_len or use a validation set of shorter sentences"
        )


def train_stream(cfg: DataConfig) -> IterableDataset:
    """The training split as a cleaned stream (data.streaming)."""
    if cfg.corpus == "synthetic":
        return _pairs_dataset(_synthetic_train(cfg)).to_iterable_dataset(num_shards=8)
    return clean_stream(stream_split(source_spec(cfg), cfg.train_split), clean_spec(cfg.clean))


def _build_streaming(cfg: DataConfig, path: Path) -> Prepared:
    """Streaming: the store holds the tokenizer (trained on the stream's first pairs) and the
    validation set; training pairs are read, cleaned and tokenised on the fly."""
    splits = synthetic_splits(cfg) if cfg.corpus == "synthetic" else test_splits(cfg)
    if cfg.corpus != "synthetic":
        splits.valid = load_split(source_spec(cfg), cfg.valid_split)
    sample = Dataset.from_list(list(train_stream(cfg).take(cfg.tokenizer_sample)))
    tok = train_tokenizer(_texts(sample), cfg.vocab_size, cfg.tokenizer)
    empty = to_dataset(_pairs_dataset([]), tok)
    valid = to_dataset(splits.valid, tok)
    check_valid(valid, cfg)
    write_store(path, tok, empty, valid, {"dropped_too_long": 0, "report": []})
    splits.valid = valid
    return Prepared(splits, tok, empty, valid, 0, path, built=True)


class TrainBatches:
    """The training batches of one data-parallel rank, with a resumable position.

    ``state_dict()`` is plain JSON data. Pre-tokenised data keeps one global position, the same on
    every rank and valid for any number of ranks; a streamed corpus keeps each rank's own stream
    state, valid only for the same number of ranks (``per_rank``)."""

    def __init__(
        self, data: Prepared, cfg: DataConfig, seed: int, dp_rank: int = 0, dp_size: int = 1
    ) -> None:
        self.data, self.per_rank = data, cfg.streaming
        if cfg.streaming:
            self.stream: StreamingBatches | None = StreamingBatches(
                train_stream(cfg),
                data.tokenizer,
                cfg.max_tokens,
                seed,
                cfg.shuffle_buffer,
                max_len=cfg.max_len,
                dp_rank=dp_rank,
                dp_size=dp_size,
            )
            self.batches: BatchIterator | None = None
        else:
            self.stream = None
            src_len, tgt_len = length_arrays(data.train)
            self.batches = BatchIterator(
                src_len, tgt_len, cfg.max_tokens, seed, dp_rank=dp_rank, dp_size=dp_size
            )
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self._it is None:
            self._it = iter(self.stream) if self.stream is not None else iter(self.batches)  # type: ignore[arg-type]
        item = next(self._it)
        if self.stream is not None:
            assert isinstance(item, Batch)
            return item
        assert isinstance(item, np.ndarray)
        return collate(self.data.train, item)

    def state_dict(self) -> dict[str, Any]:
        if self.stream is not None:
            return {"stream": self.stream.state_dict()}
        assert self.batches is not None
        return {"epoch": self.batches.state.epoch, "taken": self.batches.state.taken}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._it = None
        if self.stream is not None:
            self.stream.load_state_dict(state["stream"])
        else:
            assert self.batches is not None
            self.batches.state = BatchState(int(state["epoch"]), int(state["taken"]))


def _build(cfg: DataConfig, path: Path) -> Prepared:
    if cfg.streaming:
        return _build_streaming(cfg, path)
    splits = corpus_splits(cfg)
    tok = train_tokenizer(_texts(_sample(splits.train, cfg.tokenizer_sample)), cfg.vocab_size, cfg.tokenizer)
    num_proc = cfg.num_proc if cfg.num_proc > 1 else None
    valid = to_dataset(splits.valid, tok)
    check_valid(valid, cfg)  # before the long work on the training split
    train = tokenized = to_dataset(splits.train, tok, num_proc, text=False)
    before = len(train)
    train = train.filter(
        lambda s, t: fits(np.asarray(s), np.asarray(t), cfg.max_len),
        input_columns=["src_len", "tgt_len"],
        batched=True,
        batch_size=10_000,
    )
    if len(train) == 0:
        raise CorpusError(
            f"no training pair is shorter than data.max_len={cfg.max_len} tokens; raise data.max_len"
        )
    dropped = before - len(train)
    write_store(path, tok, train, valid, {"dropped_too_long": dropped, "report": splits.report})
    scratch = splits.scratch | made_files(tokenized, train, valid)
    stored = load_store(path)  # read back memory-mapped, as every later run will
    assert stored is not None
    _, train, valid, _ = stored
    splits.train, splits.valid = _pairs_dataset([]), valid  # nothing reads the training text any more
    _drop_scratch(scratch)
    return Prepared(splits, tok, train, valid, dropped, path, built=True)


def made_files(*datasets: Dataset) -> set[str]:
    """The ``cache-*.arrow`` files behind these Datasets: what ``datasets`` wrote for a map or a filter
    (a hub download, a parquet conversion or a save_to_disk directory has other names)."""
    files = {f["filename"] for ds in datasets for f in ds.cache_files}
    return {f for f in files if Path(f).name.startswith("cache-") and f.endswith(".arrow")}


def _drop_scratch(files: set[str]) -> None:
    """Delete the cache files this preparation's maps and filters wrote, once the store holds their
    result (at WMT scale several copies of the corpus: flattened, cleaned, tokenised). Only the files
    this process's Datasets were backed by; the converted corpus itself stays, so a later preparation
    with other settings starts from it (and redoes the maps). Not ``Dataset.cleanup_cache_files``:
    that empties the whole cache directory, including files another preparation is writing."""
    for name in sorted(files):
        Path(name).unlink(missing_ok=True)


def _sample(train: Dataset, n: int) -> Dataset:
    """``n`` pairs spread evenly over the corpus (every k-th; the whole corpus when it has at most
    ``n``): the tokenizer's training text, as WMT recipes learn BPE on a sample. Deterministic."""
    if len(train) <= n:
        return train
    step = len(train) / n
    return train.select(int(i * step) for i in range(n))


def _texts(train: Dataset) -> Iterator[list[str]]:
    for column in ("src", "tgt"):
        for start in range(0, len(train), 10_000):
            yield train[start : start + 10_000][column]


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
