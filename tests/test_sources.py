"""Corpus sources and cleaning on data the tests write: hub parquet layout, save_to_disk, text pairs
(plain and gzipped), and every bad-input case with its message."""

from __future__ import annotations

import gzip
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset, DatasetDict

from tpe_train.data.clean import CleanSpec, clean
from tpe_train.data.dedup import first_of_each
from tpe_train.data.prepare import format_report
from tpe_train.data.sources import CorpusError, SourceSpec, load_split

PAIRS = [("Hello world", "Hallo Welt"), ("A cat.", "Eine Katze."), ("Thank you", "Danke")]


def write_hub_layout(root: Path, split: str, pairs: list[tuple[str, str]], shards: int = 2) -> None:
    folder = root / "de-en"
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(shards):
        part = pairs[i::shards]
        records = [{"de": de, "en": en} for en, de in part]
        table = pa.table(
            {"translation": pa.array(records, type=pa.struct([("de", pa.string()), ("en", pa.string())]))}
        )
        pq.write_table(table, folder / f"{split}-{i:05d}-of-{shards:05d}.parquet")


def spec(kind: str, path: Path, **kw: str) -> SourceSpec:
    return SourceSpec(kind=kind, src_lang="en", tgt_lang="de", path=str(path), **kw)  # type: ignore[arg-type]


def test_parquet_in_hub_layout(tmp_path: Path) -> None:
    write_hub_layout(tmp_path, "train", PAIRS)
    write_hub_layout(tmp_path, "test", PAIRS[:1], shards=1)
    ds = load_split(spec("parquet", tmp_path), "train")
    assert sorted(zip(ds["src"], ds["tgt"], strict=True)) == sorted(PAIRS)
    assert load_split(spec("parquet", tmp_path), "test")["tgt"] == ["Hallo Welt"]
    # reversed direction through the same files
    rev = SourceSpec(kind="parquet", src_lang="de", tgt_lang="en", path=str(tmp_path))
    assert sorted(load_split(rev, "train")["src"]) == sorted(de for _, de in PAIRS)


def test_parquet_missing_split_and_language(tmp_path: Path) -> None:
    write_hub_layout(tmp_path, "train", PAIRS)
    with pytest.raises(CorpusError, match=r"no parquet files for split 'validation'.*splits present: train"):
        load_split(spec("parquet", tmp_path), "validation")
    fr = SourceSpec(kind="parquet", src_lang="en", tgt_lang="fr", path=str(tmp_path), hub_config="de-en")
    with pytest.raises(CorpusError, match="no language fr"):
        load_split(fr, "train")


def test_save_to_disk_directory(tmp_path: Path) -> None:
    dd = DatasetDict(
        {"train": Dataset.from_dict({"translation": [{"en": en, "de": de} for en, de in PAIRS]})}
    )
    dd.save_to_disk(str(tmp_path / "saved"))
    ds = load_split(spec("disk", tmp_path / "saved"), "train")
    assert list(zip(ds["src"], ds["tgt"], strict=True)) == PAIRS
    with pytest.raises(CorpusError, match="no split 'test'"):
        load_split(spec("disk", tmp_path / "saved"), "test")


def test_a_folder_save_to_disk_did_not_write_is_a_corpus_error(tmp_path: Path) -> None:
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "notes.txt").write_text("mine\n")
    with pytest.raises(CorpusError, match=r"is not a folder written by save_to_disk") as caught:
        load_split(spec("disk", tmp_path / "saved"), "train")
    assert type(caught.value) is CorpusError  # was datasets' FileNotFoundError


def _damaged_page(path: Path, text: str) -> None:
    """Overwrite ``text`` where a data page of the parquet file ``path`` holds it (the footer reads)."""
    data = path.read_bytes()
    at = data.index(text.encode())  # the first copy: the page's values, before the footer's statistics
    path.write_bytes(data[:at] + b"\xff" * len(text) + data[at + len(text) :])


def test_a_damaged_page_names_its_file_read_whole_or_streamed(tmp_path: Path) -> None:
    from tpe_train.data.sources import stream_split

    write_hub_layout(tmp_path, "train", PAIRS, shards=3)
    damaged = tmp_path / "de-en" / "train-00001-of-00003.parquet"
    _damaged_page(damaged, PAIRS[1][0])
    for read in (lambda: load_split(spec("parquet", tmp_path), "train"),
                 lambda: list(stream_split(spec("parquet", tmp_path), "train"))):  # fmt: skip
        with pytest.raises(CorpusError) as caught:
            read()
        assert type(caught.value) is CorpusError  # streamed: was pyarrow's ArrowInvalid while iterating
        assert f"{damaged}: row group 0 cannot be read" in str(caught.value)


def test_a_streamed_pair_with_a_missing_side_names_the_file(tmp_path: Path) -> None:
    from tpe_train.data.sources import stream_split

    path = tmp_path / "train-00000-of-00001.parquet"
    pq.write_table(pa.table({"src": ["a", "b"], "tgt": ["x", None]}), path)
    with pytest.raises(CorpusError, match=r"row group 0 has a pair with a missing \(null\) side") as caught:
        list(stream_split(spec("parquet", tmp_path), "train"))
    assert type(caught.value) is CorpusError and str(path) in str(caught.value)


def test_a_parquet_split_streams_the_pairs_it_reads_whole_one_shard_per_row_group(tmp_path: Path) -> None:
    from datasets.distributed import split_dataset_by_node

    from tpe_train.data.sources import stream_split

    pairs = [(f"sentence {i}", f"Satz {i}") for i in range(30)]
    write_hub_layout(tmp_path, "train", pairs, shards=3)
    whole = load_split(spec("parquet", tmp_path), "train")
    streamed = stream_split(spec("parquet", tmp_path), "train")
    assert streamed.n_shards == 3 and streamed.column_names == ["src", "tgt"]
    rows = [(r["src"], r["tgt"]) for r in streamed]
    assert sorted(rows) == sorted(zip(whole["src"], whole["tgt"], strict=True)) == sorted(pairs)
    ranks = [[r["src"] for r in split_dataset_by_node(streamed, rank=k, world_size=3)] for k in range(3)]
    assert sorted(s for rank in ranks for s in rank) == sorted(p[0] for p in pairs)
    assert all(len(rank) == 10 for rank in ranks)  # whole row groups per rank


@pytest.mark.parametrize("gz", [False, True])
def test_text_pairs_plain_and_gzipped(tmp_path: Path, gz: bool) -> None:
    for lang, side in (("en", 0), ("de", 1)):
        data = "".join(p[side] + "\n" for p in PAIRS).encode()
        if gz:
            (tmp_path / f"train.{lang}.gz").write_bytes(gzip.compress(data))
        else:
            (tmp_path / f"train.{lang}").write_bytes(data)
    ds = load_split(spec("text", tmp_path), "train")
    assert list(zip(ds["src"], ds["tgt"], strict=True)) == PAIRS


def test_text_line_counts_differ(tmp_path: Path) -> None:
    (tmp_path / "train.en").write_text("a\nb\nc\n")
    (tmp_path / "train.de").write_text("a\nb\n")
    with pytest.raises(CorpusError, match=r"train.en has 3 lines but .*train.de has 2"):
        load_split(spec("text", tmp_path), "train")


def test_text_not_utf8_names_file_and_line_or_replaces(tmp_path: Path) -> None:
    (tmp_path / "train.en").write_bytes(b"ok\nbad \xff byte\n")
    (tmp_path / "train.de").write_text("gut\nschlecht\n")
    with pytest.raises(CorpusError, match=r"train.en line 2 is not UTF-8.*bad_utf8=replace"):
        load_split(spec("text", tmp_path), "train")
    ds = load_split(spec("text", tmp_path, bad_utf8="replace"), "train")
    assert ds["src"][1] == "bad \ufffd byte"


def test_text_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match=r"train.en .* not found"):
        load_split(spec("text", tmp_path), "train")


def test_cleaning_counts_each_reason() -> None:
    pairs = {
        "src": ["  Hello\u00a0  world ", "", "one", "a b c d e f g h i j", "x", "same pair", "same pair"],
        "tgt": [
            "Hallo Welt",
            "leer",
            "eins",
            "k",
            "y y y y y y y y y y y y y y y y y y y y",
            "gleich",
            "gleich",
        ],
    }
    ds, dropped = clean(Dataset.from_dict(pairs), CleanSpec(max_words=12, max_ratio=9.0))
    ds, dropped["duplicate"] = first_of_each(ds)  # the next stage
    assert ds["src"][0] == "Hello world"  # NFKC turns the no-break space into a space; collapsed
    assert dropped == {"empty": 1, "too_short": 0, "too_long": 1, "ratio": 1, "duplicate": 1}
    assert list(ds["src"]) == ["Hello world", "one", "same pair"]
    assert format_report("train", 7, dropped) == (
        "train: 3 of 7 pairs kept (dropped: empty 1, too_long 1, ratio 1, duplicate 1)"
    )


def _write_text_corpus(root: Path, n_train: int = 300) -> None:
    from tpe_train.data import synthetic

    splits = {
        "train": synthetic.generate(n_train, 1, 4, 12),
        "validation": synthetic.generate(20, 2, 4, 12),
        "test": synthetic.generate(20, 3, 4, 12),
    }
    root.mkdir(parents=True, exist_ok=True)
    for split, pairs in splits.items():
        (root / f"{split}.en").write_text("".join(s + "\n" for s, _ in pairs))
        (root / f"{split}.de.gz").write_bytes(gzip.compress("".join(t + "\n" for _, t in pairs).encode()))


@pytest.mark.integration
def test_training_on_a_text_corpus_end_to_end(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    _write_text_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "tpe_train.train", "--preset", "demo", "data.corpus=text",
        f"data.path={tmp_path / 'corpus'}", "data.vocab_size=200", "model.d_model=32", "model.ffn_dim=64",
        "model.encoder_layers=1", "model.decoder_layers=1", "train.max_steps=3", "train.valid_every=3",
        "train.valid_bleu_size=4", "train.progress=false", "eval.beam=1", f"train.run_dir={out}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cleaning train: 300 of 300 pairs kept" in proc.stdout
    figures = json.loads((out / "eval.json").read_text())
    assert figures["test_sentences"] == 20 and figures["probe_accuracy"] is None


@pytest.mark.integration
def test_bad_corpus_stops_the_cli_with_one_message(tmp_path: Path) -> None:
    import subprocess
    import sys

    _write_text_corpus(tmp_path / "corpus")
    (tmp_path / "corpus" / "train.en").write_text("only one line\n")
    cmd = [
        sys.executable, "-m", "tpe_train.train", "data.corpus=text", f"data.path={tmp_path / 'corpus'}",
        f"train.run_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "train.en has 1 lines but" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "checkpoint").exists()


def test_corpus_empty_after_cleaning_is_refused_before_training(tmp_path: Path) -> None:
    from tpe_train.config import load_config
    from tpe_train.data.prepare import prepare

    _write_text_corpus(tmp_path / "corpus", n_train=20)
    cfg = load_config(
        "demo", ["data.corpus=text", f"data.path={tmp_path / 'corpus'}", "data.clean.max_words=2"]
    )
    with pytest.raises(
        CorpusError, match=r"no training pair is left after cleaning \(train: 0 of 20 pairs kept"
    ):
        prepare(cfg.data)


def test_data_path_is_required_for_local_corpora() -> None:
    from tpe_train.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"data.corpus=text reads a local directory, but data.path"):
        load_config("demo", ["data.corpus=text"])
