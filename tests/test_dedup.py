"""De-duplication in bounded memory (tpe_train/data/dedup.py): the same pairs, in the same order, with
the same count as keeping the first of each pair in a Python dict, however many buckets and batches
it takes; its bucket files are gone afterwards, also when it stops part-way."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from datasets import Dataset
from hypothesis import given, settings
from hypothesis import strategies as st

from tpe_train.data import dedup
from tpe_train.data.dedup import bits_at, bucket_bits, first_of_each


def _reference(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The first of each pair, in corpus order: every pair held as a Python object. A pair is its two
    sides joined by a tab, as the hashed key is (cleaning has made every tab a space before)."""
    first: dict[str, tuple[str, str]] = {}
    for src, tgt in pairs:
        first.setdefault(f"{src}\t{tgt}", (src, tgt))
    return list(first.values())


def _dataset(pairs: list[tuple[str, str]]) -> Dataset:
    return Dataset.from_dict({"src": [s for s, _ in pairs], "tgt": [t for _, t in pairs]})


def _pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """Many duplicates (a small vocabulary), unique pairs, and two pairs equal as joined text."""
    rng = random.Random(seed)
    pairs = [(rng.choice("abcdef"), rng.choice("xyz")) for _ in range(n)]
    pairs += [(f"only {i}", "once") for i in range(n // 3)] + [("a\tb", "c"), ("a", "b\tc"), ("x", "a")]
    rng.shuffle(pairs)
    return pairs


@pytest.mark.parametrize(
    ("bucket_rows", "batch_size"),
    [(dedup.BUCKET_ROWS, dedup.BATCH_SIZE), (64, 50), (4, 7), (1, 1000)],  # one bucket; 32; 256 (most)
)
def test_keeps_the_first_of_each_pair_in_order(bucket_rows: int, batch_size: int, tmp_path: Path) -> None:
    pairs = _pairs(3000)
    kept, dropped = first_of_each(_dataset(pairs), bucket_rows, batch_size, scratch=tmp_path)
    want = _reference(pairs)
    assert list(zip(kept["src"], kept["tgt"], strict=True)) == want
    assert dropped == len(pairs) - len(want) > 2000
    assert list(tmp_path.iterdir()) == []  # the bucket files and their folder are gone


def test_the_bucket_count_follows_the_rows() -> None:
    assert bucket_bits(0, 64) == bucket_bits(64, 64) == 0
    assert bucket_bits(65, 64) == 1 and bucket_bits(128, 64) == 1 and bucket_bits(129, 64) == 2
    assert bucket_bits(36_000_000, dedup.BUCKET_ROWS) == 5  # 32 buckets of about 1.1M rows
    assert bucket_bits(10**12, 1) == dedup.MAX_BITS


def test_a_corpus_without_duplicates_comes_back_as_it_is(tmp_path: Path) -> None:
    ds = _dataset([(f"s{i}", f"t{i}") for i in range(100)])
    assert first_of_each(ds, 8, 16, scratch=tmp_path) == (ds, 0)
    empty = _dataset([])
    assert first_of_each(empty, scratch=tmp_path) == (empty, 0)
    assert list(tmp_path.iterdir()) == []


def test_a_filtered_dataset_on_disk_keeps_rows_of_its_view_and_scratch_goes_beside_it(tmp_path: Path) -> None:
    pairs = _pairs(600, seed=1)
    _dataset(pairs).save_to_disk(str(tmp_path / "saved"))
    ds = Dataset.load_from_disk(str(tmp_path / "saved")).filter(lambda r: r["tgt"] != "y")  # an indices view
    view = [p for p in pairs if p[1] != "y"]
    assert dedup.scratch_root(ds) == tmp_path / "saved"
    kept, dropped = first_of_each(ds, bucket_rows=16, batch_size=37)
    assert list(zip(kept["src"], kept["tgt"], strict=True)) == _reference(view)
    assert dropped == len(view) - len(_reference(view))
    assert not any(p.name.startswith("tpe-dedup-") for p in (tmp_path / "saved").iterdir())


def test_the_bucket_files_are_removed_when_it_stops_part_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def stop(paths: list[Path], rows: int) -> tuple[np.ndarray, int]:
        assert sum(p.stat().st_size for p in paths) > 0 and len(list(tmp_path.iterdir())) == 1
        raise RuntimeError("stopped between the passes")

    monkeypatch.setattr(dedup, "_keep_bitmap", stop)
    with pytest.raises(RuntimeError, match="stopped between the passes"):
        first_of_each(_dataset(_pairs(500)), bucket_rows=16, scratch=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_the_bitmap_is_packbits_ordered() -> None:
    rows = np.array([0, 3, 7, 8, 9, 23], dtype=np.int64)
    bitmap = np.zeros(3, dtype=np.uint8)
    dedup._set_bits(bitmap, rows)
    assert np.flatnonzero(np.unpackbits(bitmap)).tolist() == rows.tolist()
    assert np.flatnonzero(bits_at(bitmap, np.arange(24))).tolist() == rows.tolist()


@settings(max_examples=40, deadline=None)
@given(
    pairs=st.lists(
        st.tuples(st.sampled_from(["a", "b", "a b", ""]), st.sampled_from(["x", "y"])), max_size=60
    ),
    bucket_rows=st.integers(1, 70),
    batch_size=st.integers(1, 70),
)
def test_any_corpus_any_buckets_any_batches(
    pairs: list[tuple[str, str]], bucket_rows: int, batch_size: int
) -> None:
    kept, dropped = first_of_each(_dataset(pairs), bucket_rows, batch_size)
    assert list(zip(kept["src"], kept["tgt"], strict=True)) == _reference(pairs)
    assert dropped == len(pairs) - len(_reference(pairs))
