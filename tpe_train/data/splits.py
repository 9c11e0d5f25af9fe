"""The corpus's splits as a run sees them: ``Splits`` (train and valid as Datasets; test, long and probe
as text pairs), the synthetic corpus's splits, the test split alone (what evaluation reads), and the
training split as a cleaned stream (``data.streaming``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from datasets import Dataset, IterableDataset

from tpe_train.config import SyntheticConfig
from tpe_train.data import synthetic
from tpe_train.data.clean import CleanSpec, clean_stream
from tpe_train.data.sources import load_split, stream_split
from tpe_train.data.specs import CorpusSpec


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
    scratch: set[str] = field(default_factory=set)  # datasets cache files made on the way (data/scratch.py)


def pairs_dataset(pairs: list[synthetic.Pair]) -> Dataset:
    """Text pairs as a src/tgt Dataset."""
    return Dataset.from_dict({"src": [p[0] for p in pairs], "tgt": [p[1] for p in pairs]})


def pairs_of(ds: Dataset, limit: int | None = None) -> list[synthetic.Pair]:
    """The first ``limit`` (all) rows of a src/tgt Dataset as text pairs."""
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    return list(zip(ds["src"], ds["tgt"], strict=True))


def _synthetic_train(s: SyntheticConfig) -> list[synthetic.Pair]:
    return synthetic.generate(s.train_size, s.seed, s.min_words, s.max_words)


def synthetic_splits(s: SyntheticConfig) -> Splits:
    """All splits of the embedded corpus; disjoint sources, a pure function of the section."""
    train = _synthetic_train(s)
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
    return Splits(pairs_dataset(train), pairs_dataset(valid), test, long, probe, pretokenized=True)


def test_splits(corpus: CorpusSpec) -> Splits:
    """Only what evaluation reads: test (and, synthetic, long and probe) sets."""
    if corpus.kind == "synthetic":
        return synthetic_splits(corpus.synthetic)
    empty = pairs_dataset([])
    return Splits(empty, empty, pairs_of(load_split(corpus.source, corpus.test_split)))


def train_stream(corpus: CorpusSpec, clean: CleanSpec) -> IterableDataset:
    """The training split as a cleaned stream (data.streaming; de-duplication needs the whole corpus,
    and the config refuses it with streaming)."""
    if corpus.kind == "synthetic":
        return pairs_dataset(_synthetic_train(corpus.synthetic)).to_iterable_dataset(num_shards=8)
    return clean_stream(stream_split(corpus.source, corpus.train_split), clean)
