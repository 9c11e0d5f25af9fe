"""Random bytes into the readers of data folders: a token store, a ``save_to_disk`` corpus, a hub-layout
parquet corpus (read whole and streamed). Only the project's own errors come out.

A real tiny token store is built once (``prepare``, the synthetic corpus); each example copies it,
replaces one of its files (``meta.json``, ``tokenizer.json``, a split's ``state.json``,
``dataset_info.json`` or Arrow file) with random bytes, random JSON, the real JSON with one value
replaced, or the real file cut short or with bytes overwritten, and prepares again: the store is reused
and a first batch of each split is read, or a ``MemberError`` names the file and says to delete the store.
The corpora: one file of a ``save_to_disk`` folder, one shard of a hub-layout split, one streamed
parquet file; each reads (every pair two strings) or raises ``CorpusError``. Examples are derandomized
(``EXAMPLES`` in all; tests/test_reader_fuzz.py checks the total that docs/reliability.md states)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict
from hypothesis import example, given
from hypothesis import strategies as st

from tests.support.fuzz import (
    contents,
    damaged_page,
    damaged_parquet,
    fuzz,
    message,
    outcome,
    overwritten,
    parquet_bytes,
    raw,
)
from tests.support.models import TINY_RUN
from tpe_train.config import DataConfig, load_config
from tpe_train.data.batching import BatchIterator, collate, length_arrays
from tpe_train.data.errors import CorpusError
from tpe_train.data.prepare import prepare  # the one place that names where preparation lives
from tpe_train.data.sources import SourceSpec, load_split, stream_split
from tpe_train.run.members import MemberError

STORE_EXAMPLES = 25  # per file of the store
STORE_FILES = (
    "meta.json",
    "tokenizer.json",
    "train/state.json",
    "train/dataset_info.json",
    "train/data-00000-of-00001.arrow",
    "valid/dataset_info.json",
    "valid/data-00000-of-00001.arrow",
)
DISK_EXAMPLES = 20  # per file of the save_to_disk corpus
DISK_FILES = (
    "dataset_dict.json",
    "train/state.json",
    "train/dataset_info.json",
    "train/data-00000-of-00001.arrow",
)
HUB_EXAMPLES = 30
STREAM_EXAMPLES = 60
EXAMPLES = (
    STORE_EXAMPLES * len(STORE_FILES) + DISK_EXAMPLES * len(DISK_FILES) + HUB_EXAMPLES + STREAM_EXAMPLES
)


def binary(original: bytes) -> st.SearchStrategy[bytes]:
    """Random replacements for a file whose real contents are ``original``, bytes overwritten included."""
    return contents(original) | overwritten(original)


# -- a token store ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def made_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[DataConfig, Path]:
    """The data config of a tiny synthetic store, and the store that ``prepare`` built for it."""
    root = tmp_path_factory.mktemp("fuzz-store")
    cfg = load_config("demo", [*TINY_RUN, f"data.store_dir={root}"]).data
    return cfg, prepare(cfg).store


def read_store(cfg: DataConfig) -> None:
    """What a run does with a store: reuse it, then read a first batch of training and validation."""
    prepared = prepare(cfg)
    assert not prepared.built  # never rebuilt over a damaged store
    for ds in (prepared.train, prepared.valid):
        src, tgt = length_arrays(ds)
        if len(src):  # (a streamed corpus's store holds no training pairs)
            collate(ds, next(iter(BatchIterator(src, tgt, cfg.max_tokens, seed=0))))


@pytest.mark.parametrize("name", STORE_FILES)
@fuzz(STORE_EXAMPLES)
@given(data=st.data())
def test_a_token_store_file_of_random_bytes_gives_a_member_error(
    made_store: tuple[DataConfig, Path], name: str, data: st.DataObject
) -> None:
    cfg, made = made_store
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / made.name
        shutil.copytree(made, store)
        original = (store / name).read_bytes()
        new = data.draw(binary(original) if name.endswith(".arrow") else contents(original), label=name)
        (store / name).write_bytes(new)
        copy = cfg.model_copy(update={"store_dir": tmp})
        said = message(lambda: read_store(copy), (MemberError,))
        assert not said or (str(store) in said and f"delete {store} and run tpe-data prepare" in said), said


# -- a save_to_disk corpus ----------------------------------------------------------------------------
PAIRS = [{"de": f"ein haus {i}", "en": f"a house {i}"} for i in range(20)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fuzz-saved") / "saved"
    DatasetDict({"train": Dataset.from_dict({"translation": PAIRS})}).save_to_disk(str(path))
    return path


def read_pairs(spec: SourceSpec, split: str = "train") -> None:
    ds = load_split(spec, split)
    assert all(isinstance(s, str) for s in ds["src"]) and all(isinstance(t, str) for t in ds["tgt"])


@pytest.mark.parametrize("name", DISK_FILES)
@fuzz(DISK_EXAMPLES)
@given(data=st.data())
def test_a_save_to_disk_file_of_random_bytes_gives_a_corpus_error(
    saved: Path, name: str, data: st.DataObject
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "saved"
        shutil.copytree(saved, path)
        original = (path / name).read_bytes()
        new = data.draw(binary(original) if name.endswith(".arrow") else contents(original), label=name)
        (path / name).write_bytes(new)
        spec = SourceSpec(kind="disk", src_lang="de", tgt_lang="en", path=str(path))
        outcome(lambda: read_pairs(spec), (CorpusError,))


# -- parquet corpora, read whole and streamed -------------------------------------------------------
def hub_shard(i: int) -> bytes:
    """Shard ``i`` of 3 of a hub-layout split: translation records, two row groups."""
    import pyarrow as pa

    rows = PAIRS[i::3]
    kind = pa.struct([("de", pa.string()), ("en", pa.string())])
    return parquet_bytes({"translation": pa.array(rows, type=kind)}, row_group_size=4)


SHARDS = [hub_shard(i) for i in range(3)]
MANY_PAGES = parquet_bytes(
    {
        "src": [f"ein langes haus {i}" * (i % 5) for i in range(120)],
        "tgt": [f"a house {i}" for i in range(120)],
    },
    row_group_size=30,
)


def read_stream(spec: SourceSpec) -> None:
    pairs = list(stream_split(spec, "train"))
    assert all(isinstance(p["src"], str) and isinstance(p["tgt"], str) for p in pairs)


@fuzz(HUB_EXAMPLES)
@given(shard=st.integers(0, 2), data=st.data())
def test_a_hub_layout_shard_of_random_bytes_gives_a_corpus_error(shard: int, data: st.DataObject) -> None:
    """The split read whole (``load_split``) and streamed (``stream_split``)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "de-en"
        folder.mkdir()
        for i, real in enumerate(SHARDS):
            new = (
                data.draw(st.one_of(raw, damaged_parquet(real), damaged_page(real)), label="shard")
                if i == shard
                else real
            )
            (folder / f"train-{i:05d}-of-00003.parquet").write_bytes(new)
        spec = SourceSpec(kind="parquet", src_lang="de", tgt_lang="en", path=tmp, cache_dir=f"{tmp}/cache")
        damaged = str(folder / f"train-{shard:05d}-of-00003.parquet")
        for read in (read_pairs, read_stream):
            said = message(lambda: read(spec), (CorpusError,))  # noqa: B023 (called at once)
            assert not said or damaged in said or str(folder) in said, said


@fuzz(STREAM_EXAMPLES)
@given(data=st.one_of(raw, damaged_parquet(MANY_PAGES), damaged_page(MANY_PAGES)))
@example(data=MANY_PAGES)  # the real file streams
def test_a_streamed_parquet_file_of_random_bytes_gives_a_corpus_error(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train-00000-of-00001.parquet"
        path.write_bytes(data)
        spec = SourceSpec(kind="parquet", src_lang="de", tgt_lang="en", path=tmp)
        said = message(lambda: read_stream(spec), (CorpusError,))
        assert not said or (str(path) in said and "write it again" in said), said
        assert data != MANY_PAGES or not said
