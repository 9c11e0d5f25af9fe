"""Read: the pipeline's first stage. Corpus sources behind one interface: each split becomes a
`datasets.Dataset` with ``src``/``tgt``.

Sources: a Hugging Face hub id (``wmt/wmt14``, config ``de-en``), a local directory in the hub's parquet
layout (``de-en/train-00000-of-00003.parquet``), a ``save_to_disk`` directory, plain line-aligned text
pairs (``train.en`` / ``train.de``, optionally gzipped; data/textfiles.py); the synthetic corpus is
generated instead (data/splits.py).
Problems (missing files, splits or languages, misaligned or non-UTF-8 text) raise ``CorpusError``
with a message that names the file and the fix, before any long work starts.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
from datasets import Dataset, IterableDataset
from datasets.exceptions import DatasetGenerationError

from tpe_train.data.errors import CorpusError
from tpe_train.data.parquet_stream import damaged_file, stream_parquet
from tpe_train.data.saved import load_saved, saved_splits
from tpe_train.data.textfiles import check_aligned, line_pairs, stamp, write_arrow
from tpe_train.run.atomic import temp_name

__all__ = ["CorpusError", "SourceSpec", "load_split", "stream_split"]

TEXT_FORMAT = 1  # bump when the Arrow file of a text split changes


@dataclass(frozen=True, kw_only=True)
class SourceSpec:
    """Where a corpus lives (a plain mirror of the data config: data/specs.py makes it)."""

    kind: str  # hub | parquet | disk | text
    src_lang: str
    tgt_lang: str
    path: str = ""  # parquet / disk / text directory
    hub_id: str = "wmt/wmt14"
    hub_config: str = ""  # default: "<sorted langs>", e.g. de-en
    cache_dir: str = ""  # datasets cache (default: HF_DATASETS_CACHE)
    bad_utf8: str = "error"  # text: error | replace

    @property
    def config_name(self) -> str:
        return self.hub_config or "-".join(sorted((self.src_lang, self.tgt_lang)))


def load_split(spec: SourceSpec, split: str) -> Dataset:
    """One split of the corpus as a Dataset with string columns ``src`` and ``tgt``."""
    loaders: dict[str, Callable[[SourceSpec, str], Dataset]] = {
        "hub": _hub,
        "parquet": _parquet,
        "disk": _disk,
        "text": _text,
    }
    if spec.kind not in loaders:
        raise CorpusError(f"unknown corpus kind {spec.kind!r}; choose one of {', '.join(loaders)}")
    return loaders[spec.kind](spec, split)


def _from_translation(ds: Dataset, spec: SourceSpec, where: str) -> Dataset:
    """Records ``{"translation": {lang: text}}`` (or ``src``/``tgt`` columns) -> src/tgt columns."""
    if {"src", "tgt"} <= set(ds.column_names):
        return ds.select_columns(["src", "tgt"])
    if "translation" not in ds.column_names:
        raise CorpusError(
            f"{where} has columns {ds.column_names}; expected 'translation' records "
            '({"translation": {"de": ..., "en": ...}}) or string columns src and tgt'
        )
    feature = ds.features["translation"]
    langs = list(getattr(feature, "languages", None) or feature.keys())
    missing = [lang for lang in (spec.src_lang, spec.tgt_lang) if lang not in langs]
    if missing:
        raise CorpusError(
            f"{where} has no language {', '.join(missing)} (it has {', '.join(langs)}); set "
            "data.src_lang / data.tgt_lang to languages of the corpus"
        )
    src, tgt = spec.src_lang, spec.tgt_lang

    def split_pair(batch: dict[str, list[dict[str, str]]]) -> dict[str, list[str]]:
        return {
            "src": [t[src] for t in batch["translation"]],
            "tgt": [t[tgt] for t in batch["translation"]],
        }

    return ds.map(split_pair, batched=True, remove_columns=ds.column_names)


def _hub(spec: SourceSpec, split: str) -> Dataset:
    """The real hub loader (honours ``cache_dir`` and ``HF_DATASETS_OFFLINE``)."""
    try:
        ds = datasets.load_dataset(
            spec.hub_id, spec.config_name, split=split, cache_dir=spec.cache_dir or None
        )
    except ValueError as err:  # unknown split
        raise CorpusError(f"{spec.hub_id} ({spec.config_name}) has no split {split!r}: {err}") from None
    assert isinstance(ds, Dataset)
    return _from_translation(ds, spec, f"{spec.hub_id} ({spec.config_name}, {split})")


def parquet_files(spec: SourceSpec, split: str) -> list[str]:
    """``<path>[/<config>]/<split>-*.parquet``, as the hub lays them out."""
    root = Path(spec.path)
    folder = root / spec.config_name if (root / spec.config_name).is_dir() else root
    files = sorted(folder.glob(f"{split}-*.parquet")) or sorted(folder.glob(f"{split}.parquet"))
    if not files:
        present = sorted({p.name.split("-")[0].split(".")[0] for p in folder.glob("*.parquet")})
        raise CorpusError(
            f"no parquet files for split {split!r} in {folder} (expected {split}-00000-of-0000N.parquet; "
            f"splits present: {', '.join(present) or 'none'}); point data.path at the hub layout's "
            "root or set the split names"
        )
    for path in files:
        _check_parquet(path)
    return [str(f) for f in files]


def _check_parquet(path: Path) -> None:
    """Stop when ``path``'s footer (its schema and row groups) cannot be read: not a parquet file."""
    try:
        pq.read_metadata(path)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as err:  # a column name that is not UTF-8
        raise CorpusError(
            f"{path} is not a readable parquet file ({' '.join(str(err).split())[:200]}); download or "
            f"write it again, or move it out of {path.parent}"
        ) from None


def _parquet(spec: SourceSpec, split: str) -> Dataset:
    files = parquet_files(spec, split)
    try:
        ds = datasets.load_dataset(
            "parquet", data_files={split: files}, split=split, cache_dir=spec.cache_dir or None
        )
        assert isinstance(ds, Dataset)
        ds.data.validate(full=True)  # text of a damaged page that is not UTF-8 converts: found here
    except (DatasetGenerationError, pa.ArrowInvalid) as err:  # a damaged page, the footer reading
        damaged_file(files)  # names the file, where it can
        raise CorpusError(
            f"the parquet files of split {split!r} in {Path(files[0]).parent} cannot be read "
            f"({' '.join(str(err.__cause__ or err).split())[:200]}); download or write them again"
        ) from None
    return _from_translation(ds, spec, f"{Path(files[0]).parent}/{split}-*.parquet")


def _disk(spec: SourceSpec, split: str) -> Dataset:
    """A ``save_to_disk`` folder of one Dataset or of a DatasetDict (data/saved.py reads it)."""
    path = Path(spec.path)
    if not path.exists():
        raise CorpusError(f"{path} does not exist; set data.path to a directory written by save_to_disk")
    fix = f"save the corpus again with save_to_disk, or point data.path at another copy of {path}"
    splits = saved_splits(path, CorpusError, fix)
    if splits is not None:
        if split not in splits:
            has = ", ".join(splits) or "none"
            raise CorpusError(f"{path} has no split {split!r} (it has {has}); set the split names")
        path = path / split
    return _from_translation(load_saved(path, CorpusError, fix), spec, f"{spec.path} ({split})")


def _text_file(path: Path) -> Path:
    if path.is_file():
        return path
    gz = path.with_name(path.name + ".gz")
    if gz.is_file():
        return gz
    raise CorpusError(f"{path} (or {gz.name}) not found; text corpora are <split>.<lang> line-aligned files")


def _text_paths(spec: SourceSpec, split: str) -> tuple[Path, Path]:
    root = Path(spec.path)
    return _text_file(root / f"{split}.{spec.src_lang}"), _text_file(root / f"{split}.{spec.tgt_lang}")


def _text(spec: SourceSpec, split: str) -> Dataset:
    """The pairs of two text files, read in pieces into an Arrow file under the ``datasets`` cache
    (``tpe-text/<split>-<key>.arrow``, the key following the files' contents): memory does not grow
    with the corpus, and a changed file is read again."""
    src_path, tgt_path = _text_paths(spec, split)
    check_aligned(src_path, tgt_path)
    key = hashlib.sha256(f"{TEXT_FORMAT}|{spec.bad_utf8}|{stamp(src_path, tgt_path)}".encode()).hexdigest()
    folder = Path(spec.cache_dir or datasets.config.HF_DATASETS_CACHE) / "tpe-text"
    path = folder / f"{split}-{key[:16]}.arrow"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = temp_name(path)
        try:
            write_arrow(line_pairs(str(src_path), str(tgt_path), spec.bad_utf8), tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return Dataset.from_file(str(path))


def stream_split(spec: SourceSpec, split: str) -> IterableDataset:
    """One split as an IterableDataset with ``src``/``tgt``, read lazily shard by shard."""
    if spec.kind == "hub":
        ds = datasets.load_dataset(
            spec.hub_id, spec.config_name, split=split, streaming=True, cache_dir=spec.cache_dir or None
        )
    elif spec.kind == "parquet":  # datasets' own streamed reader lets pyarrow's errors out: see there
        return stream_parquet(parquet_files(spec, split), spec.src_lang, spec.tgt_lang)
    elif spec.kind == "disk":
        ds = _disk(spec, split).to_iterable_dataset(num_shards=8)
    elif spec.kind == "text":
        src_path, tgt_path = _text_paths(spec, split)
        check_aligned(src_path, tgt_path, compressed=False)
        return IterableDataset.from_generator(
            line_pairs, gen_kwargs={"src": str(src_path), "tgt": str(tgt_path), "bad_utf8": spec.bad_utf8}
        )
    else:
        raise CorpusError(f"unknown corpus kind {spec.kind!r}")
    assert isinstance(ds, IterableDataset)
    if {"src", "tgt"} <= set(ds.column_names or []):
        return ds.select_columns(["src", "tgt"])
    src, tgt = spec.src_lang, spec.tgt_lang
    return ds.map(
        lambda r: {"src": r["translation"][src], "tgt": r["translation"][tgt]}, remove_columns=["translation"]
    )
