"""The token store: built once, reused by fingerprint, rebuilt when tokenizer or cleaning changes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tpe_train.config import load_config
from tpe_train.data.prepare import prepare
from tpe_train.data.sources import CorpusError

SMALL = [
    "data.synthetic.train_size=300",
    "data.synthetic.valid_size=10",
    "data.synthetic.test_size=10",
    "data.synthetic.long_size=0",
    "data.synthetic.probe_size=5",
    "data.vocab_size=150",
]


def cfg(tmp_path: Path, *extra: str):  # type: ignore[no-untyped-def]
    return load_config("demo", [*SMALL, f"data.store_dir={tmp_path}", *extra]).data


def test_store_is_built_then_reused(tmp_path: Path) -> None:
    first = prepare(cfg(tmp_path))
    assert first.built and (first.store / "meta.json").is_file()
    again = prepare(cfg(tmp_path))
    assert not again.built and again.store == first.store
    assert again.train["src_ids"] == first.train["src_ids"]
    assert again.tokenizer.to_str() == first.tokenizer.to_str()
    # batch size and processes do not change the tokens: same store
    assert prepare(cfg(tmp_path, "data.max_tokens=999")).store == first.store


@pytest.mark.parametrize(
    "change", ["data.vocab_size=120", "data.tokenizer=unigram", "data.clean.max_ratio=3", "data.max_len=20"]
)
def test_store_is_rebuilt_when_tokens_would_differ(tmp_path: Path, change: str) -> None:
    base = prepare(cfg(tmp_path))
    other = prepare(cfg(tmp_path, change))
    assert other.built and other.store != base.store


def test_run_directory_keeps_its_vocabulary(tmp_path: Path) -> None:
    run_tok = tmp_path / "run" / "tokenizer.json"
    prepare(cfg(tmp_path), run_tokenizer=run_tok)
    assert run_tok.is_file()
    with pytest.raises(CorpusError, match="differs from the tokenizer of the prepared data"):
        prepare(cfg(tmp_path, "data.vocab_size=120"), run_tokenizer=run_tok)


@pytest.mark.integration
def test_tpe_data_prepare_cli(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "tpe_train.data.cli", "prepare", *SMALL, f"data.store_dir={tmp_path}"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("built ") and "300 training pairs" in first.stdout
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert second.stdout.startswith("reused ")


def test_store_keeps_16_bit_ids_and_no_training_text(tmp_path: Path) -> None:
    from tpe_train.data.tokenise import token_features

    data = prepare(cfg(tmp_path))
    train, valid = data.train, data.valid
    assert set(train.column_names) == {"id", "src_ids", "tgt_ids", "src_len", "tgt_len"}
    assert train.features["src_ids"].feature.dtype == "uint16" and train.features["src_len"].dtype == "int32"
    assert {"src", "tgt"} <= set(valid.column_names)  # validation BLEU reads its references
    # the ids read back are the tokenizer's, EOS included
    first = train[0]
    assert first["src_ids"][-1] == 2 and len(first["src_ids"]) == first["src_len"]
    # a vocabulary past 16 bits keeps 32-bit ids
    assert token_features(70_000, text=False)["src_ids"].feature.dtype == "int32"
    assert token_features(65_536, text=False)["src_ids"].feature.dtype == "uint16"


def _arrow_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.arrow"))}


def test_preparing_leaves_no_map_caches_and_keeps_the_corpus_files(tmp_path: Path) -> None:
    """The maps' and filters' cache files go once the store holds their result; the hub layout's
    converted Arrow files and a save_to_disk corpus stay byte for byte, and a preparation with other
    settings still starts from them."""
    from datasets import Dataset, DatasetDict
    from test_sources import write_hub_layout

    words = ["the", "a", "cat", "dog", "sees", "chases", "small", "big", "red", "house", "tree", "near"]
    src = [" ".join(words[(i * k) % 12] for k in range(1, 3 + i % 4)) + " ." for i in range(240)]
    pairs = [(s, f"d{i % 9} e{i % 5} .") for i, s in enumerate(src)]  # 2-5 source words
    hub = tmp_path / "hub"
    for split, part in (("train", pairs), ("validation", pairs[:10]), ("test", pairs[10:20])):
        write_hub_layout(hub, split, part)
    cache = tmp_path / "hf-cache"
    common = ["data.vocab_size=120", f"data.store_dir={tmp_path / 'stores'}", "data.num_proc=2"]
    hub_cfg = load_config(
        "demo", [*common, "data.corpus=parquet", f"data.path={hub}", f"data.cache_dir={cache}"]
    )
    first = prepare(hub_cfg.data)
    assert first.built and len(first.train) == 240
    left = [p.name for p in cache.rglob("cache-*.arrow")]
    assert left == [], left
    converted = _arrow_files(cache)
    assert any("train" in name for name in converted)  # the parquet conversion itself stays
    other = prepare(load_config("demo", [*common, "data.corpus=parquet", f"data.path={hub}",
                                         f"data.cache_dir={cache}", "data.max_len=5"]).data)  # fmt: skip
    assert other.built and other.store != first.store and len(other.train) < 240
    assert _arrow_files(cache) == converted and not list(cache.rglob("cache-*.arrow"))

    saved = tmp_path / "saved"
    records = [{"en": en, "de": de} for en, de in pairs]
    DatasetDict({name: Dataset.from_dict({"translation": records[:n]}) for name, n in
                 (("train", 240), ("validation", 10), ("test", 10))}).save_to_disk(str(saved))  # fmt: skip
    before = {str(p.relative_to(saved)): p.read_bytes() for p in sorted(saved.rglob("*")) if p.is_file()}
    disk = prepare(load_config("demo", [*common, "data.corpus=disk", f"data.path={saved}"]).data)
    assert disk.built and len(disk.train) == 240
    after = {str(p.relative_to(saved)): p.read_bytes() for p in sorted(saved.rglob("*")) if p.is_file()}
    assert after == before  # the user's corpus untouched, and no cache file left beside it


def test_a_stored_split_whose_offsets_point_past_its_data_is_refused_not_read(tmp_path: Path) -> None:
    """A byte changed in an Arrow file's list offsets: ``load_from_disk`` loads it and reading its rows
    crashed the process (a segmentation fault); the store's loader validates the offsets first."""
    import struct

    import pyarrow as pa

    from tpe_train.data.store_open import load_store
    from tpe_train.run.members import MemberError

    store = prepare(cfg(tmp_path)).store
    path = store / "train" / "data-00000-of-00001.arrow"
    data = bytearray(path.read_bytes())
    whole = pa.py_buffer(bytes(data))
    offsets = pa.ipc.open_stream(pa.BufferReader(whole)).read_all().column("src_ids").chunk(0).buffers()[1]
    at = offsets.address - whole.address + 4 * 2  # the second pair's end: past every id
    data[at : at + 4] = struct.pack("<i", 10**8)
    path.write_bytes(bytes(data))
    with pytest.raises(MemberError) as caught:
        load_store(store)
    assert type(caught.value) is MemberError
    said = str(caught.value)
    assert (
        f"{path} is not a readable Arrow file" in said and f"delete {store} and run tpe-data prepare" in said
    )


def test_a_stored_split_whose_column_name_is_not_utf8_is_refused(tmp_path: Path) -> None:
    """A byte changed in a column's name: pyarrow's schema reads, and asking for the name raised a
    ``UnicodeDecodeError``; the store's loader names the file."""
    from tpe_train.data.store_open import load_store
    from tpe_train.run.members import MemberError

    store = prepare(cfg(tmp_path)).store
    path = store / "train" / "data-00000-of-00001.arrow"
    data = path.read_bytes()
    assert data.count(b"src_ids") >= 1
    path.write_bytes(data.replace(b"src_ids", b"\x80rc_ids"))
    with pytest.raises(MemberError) as caught:
        load_store(store)
    assert type(caught.value) is MemberError
    assert f"{path} is not a readable Arrow file" in str(caught.value)


@pytest.mark.parametrize(
    ("column", "change", "said"),
    [
        ("tgt_ids", lambda ids: [[*ids[0][:-1], 150], *ids[1:]], "to 150, outside its tokenizer's 150 ids"),
        ("src_ids", lambda ids: [*ids[:-1], [65535]], "to 65535, outside its tokenizer's 150 ids"),
        ("src_len", lambda lens: [lens[0] + 1, *lens[1:]], "holds a src_len that is not its src_ids' length"),
    ],
)
def test_a_stored_split_with_ids_past_its_tokenizer_or_wrong_lengths_is_refused(
    tmp_path: Path, column: str, change: Any, said: str
) -> None:
    """Valid Arrow whose values do not fit the store: an id the embedding table does not have (a CPU run
    raised IndexError in the model, a GPU run a device-side assert) or a length batching would trust."""
    import pyarrow as pa

    from tpe_train.data.store_open import load_store
    from tpe_train.run.members import MemberError

    store = prepare(cfg(tmp_path)).store
    path = store / "train" / "data-00000-of-00001.arrow"
    table = pa.ipc.open_stream(pa.BufferReader(path.read_bytes())).read_all()  # not mapped: rewritten
    field = table.schema.field(column)  # the same type: the split's description still fits its file
    values = pa.array(change(table.column(column).to_pylist()), type=field.type)
    table = table.set_column(table.schema.get_field_index(column), field, values)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(MemberError) as caught:
        load_store(store)
    assert said in str(caught.value) and f"{store / 'train'}" in str(caught.value)
    assert f"delete {store} and run tpe-data prepare" in str(caught.value)
