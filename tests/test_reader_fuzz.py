"""Random bytes into every reader of files from elsewhere: only the project's own errors come out.

Corpus text files (plain and ``.gz``: invalid UTF-8, NULs, carriage returns, encoded surrogates,
truncated or forged gzip), and every file of a real tiny checkpoint and its export (``manifest.json``,
``index.json``, ``trainer.json``, ``config.yaml``, ``tokenizer.json``, ``latest``, a safetensors file's
header, ``meta.json``, the export's weights), and the output marker of its native, HF and CTranslate2
exports (``.tpe-output.json``: the one file of an HF or CTranslate2 export that tpe-train reads back)
replaced by random bytes, random JSON, or the real JSON with one value replaced. A reader either reads
the file or raises ``CorpusError`` / ``CheckpointError`` / ``MemberError`` / ``ConfigError`` /
``OutputRefused`` (checked by exact class), never a library's ``UnicodeDecodeError``, ``EOFError``,
``zlib.error``, ``RecursionError``, ``KeyError`` or ``TypeError``. Examples are derandomized: the same
ones each run (``EXAMPLES`` here; the data folders' in tests/test_reader_fuzz_data.py)."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import example, given
from hypothesis import strategies as st
from test_eval_figures_fuzz import EXAMPLES as FIGURES_EXAMPLES
from test_reader_fuzz_data import EXAMPLES as DATA_EXAMPLES

from tests.support.fuzz import PARQUET, contents, damaged_parquet, drawn, fuzz, gzipped, outcome, raw
from tpe_train.ckpt import cli as ckpt_cli
from tpe_train.ckpt import commands as ckpt_commands
from tpe_train.ckpt import export, shards, state, store
from tpe_train.ckpt.errors import CheckpointError, UnknownFormat
from tpe_train.ckpt.rundir import RunDir
from tpe_train.config import Config, ConfigError, validate
from tpe_train.data.check import scan_file
from tpe_train.data.errors import CorpusError
from tpe_train.data.sources import SourceSpec, load_split
from tpe_train.data.textfiles import check_aligned, count_lines, line_pairs, raw_lines
from tpe_train.run.members import MemberError
from tpe_train.run.outputs import MARKER, OutputRefused, check_output, record

pytestmark = pytest.mark.integration  # the checkpoint is made by the real tpe-train

CORPUS_EXAMPLES = 150
PAIR_EXAMPLES = 60
PARQUET_EXAMPLES = 30
FILE_EXAMPLES = 40  # per checkpoint or export file
CKPT_FILES = ("manifest.json", "index.json", "trainer.json", "config.yaml", "tokenizer.json", "latest")
EXPORT_FILES = ("meta.json", "config.yaml", "tokenizer.json", "model.safetensors")
FILES = len(CKPT_FILES) + 1 + len(EXPORT_FILES)  # with the safetensors header
MARKER_EXAMPLES = 20  # per export format: native, hf, ctranslate2 (export.KINDS)
READERS = CORPUS_EXAMPLES + PAIR_EXAMPLES + PARQUET_EXAMPLES + FILE_EXAMPLES * FILES
EXAMPLES = READERS + MARKER_EXAMPLES * len(export.KINDS)
CKPT_ERRORS = (CheckpointError, shards.ShardError, UnknownFormat, MemberError, ConfigError)


# -- corpus text files -------------------------------------------------------------------------------
def _read_side(path: Path) -> None:
    lines = list(raw_lines(path))
    assert count_lines(path) == len(lines)
    assert scan_file(path).lines == len(lines)


@fuzz(CORPUS_EXAMPLES)
@given(data=raw | gzipped(), gz=st.booleans())
@example(data=gzip.compress(b"a\nb\n")[:-4], gz=True)  # a truncated stream
@example(data=b"plain text\n", gz=True)  # a plain file named .gz
def test_a_corpus_side_of_random_bytes_reads_or_gives_a_corpus_error(data: bytes, gz: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ("train.de.gz" if gz else "train.de")
        path.write_bytes(data)
        outcome(lambda: _read_side(path), (CorpusError,))


sides = raw | gzipped()


@fuzz(PAIR_EXAMPLES)
@given(src=sides, tgt=sides, gz=st.booleans(), bad_utf8=st.sampled_from(["error", "replace"]))
def test_a_pair_of_random_sides_reads_aligned_or_gives_a_corpus_error(
    src: bytes, tgt: bytes, gz: bool, bad_utf8: str
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        suffix = ".gz" if gz else ""
        s, t = Path(tmp) / f"train.de{suffix}", Path(tmp) / f"train.en{suffix}"
        s.write_bytes(src)
        t.write_bytes(tgt)

        def read() -> None:
            check_aligned(s, t)
            pairs = list(line_pairs(str(s), str(t), bad_utf8))
            assert len(pairs) == count_lines(s) == count_lines(t)
            assert all(isinstance(p["src"], str) and isinstance(p["tgt"], str) for p in pairs)

        outcome(read, (CorpusError,))


@fuzz(PARQUET_EXAMPLES)
@given(data=raw | damaged_parquet())
@example(data=PARQUET)  # the real file reads
def test_a_parquet_split_of_random_bytes_reads_or_gives_a_corpus_error(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "train-00000-of-00001.parquet").write_bytes(data)
        spec = SourceSpec(kind="parquet", src_lang="de", tgt_lang="en", path=tmp, cache_dir=f"{tmp}/cache")

        def read() -> None:
            ds = load_split(spec, "train")
            assert ds.column_names == ["src", "tgt"] and all(isinstance(s, str) for s in ds["src"])

        result = outcome(read, (CorpusError,))
        assert result == "read" or data != PARQUET


# -- a real checkpoint and its export ------------------------------------------------------------------
@pytest.fixture(scope="module")
def made(tiny_run: Path) -> Path:
    """The session's real tiny run (``tiny_run`` of tests/conftest.py): read here, never changed."""
    global RUN_CONFIG
    RUN_CONFIG = validate(yaml.safe_load((tiny_run / "run" / "config.yaml").read_text()))
    return tiny_run / "run"


RUN_CONFIG = Config()  # the made run's, for the resume's comparison


def forge(folder: Path, name: str, data: bytes, listing: str) -> None:
    """Replace ``folder/name`` and record its size and hash in ``listing`` (a checkpoint's manifest or
    an export's meta), as a forger would: the reader then parses the new contents."""
    (folder / name).write_bytes(data)
    listed = json.loads((folder / listing).read_text())
    digest = hashlib.sha256(data).hexdigest()
    if listing == store.MANIFEST:
        listed["files"][name] = {"size": len(data), "sha256": digest}
    else:
        listed["sha256"][name] = digest
    (folder / listing).write_text(json.dumps(listed))


def read_checkpoint(ckpt: Path) -> None:
    """What a resume, ``tpe-ckpt list`` and an offline export read of a checkpoint."""
    entry = store.inspect(ckpt)
    store.check_compatible(ckpt, RUN_CONFIG)
    store.latest_named(ckpt.parent)
    store.verify_all(ckpt)
    state.read_trainer(ckpt)
    export.read_setup(ckpt)
    index = shards.read_index(ckpt)
    name = next(iter(index["tensors"]))
    shards.read_tensor(ckpt, index, name)
    assert entry.complete, entry.reason


def _scratch(made: Path, tmp: str) -> Path:
    """A copy of the run's last checkpoint (with ``latest`` beside it) under ``tmp``."""
    root = Path(tmp) / "checkpoints"
    ckpt = root / (made / "checkpoints" / store.LATEST).read_text().strip()
    shutil.copytree(made / "checkpoints" / ckpt.name, ckpt)
    shutil.copy(made / "checkpoints" / store.LATEST, root / store.LATEST)
    return ckpt


@pytest.mark.parametrize("name", CKPT_FILES)
@fuzz(FILE_EXAMPLES)
@given(data=st.data())
@example(data=None).via("a deeply nested JSON value")
def test_a_checkpoint_file_of_random_bytes_gives_a_checkpoint_error(
    made: Path, name: str, data: st.DataObject | None
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = _scratch(made, tmp)
        where = ckpt.parent if name == store.LATEST else ckpt
        new = b"[" * 100_000 if data is None else drawn(data, name, (where / name).read_bytes())
        if name in (store.MANIFEST, store.LATEST):
            (where / name).write_bytes(new)
        else:
            forge(ckpt, name, new, store.MANIFEST)
        outcome(lambda: read_checkpoint(ckpt), CKPT_ERRORS)


@fuzz(FILE_EXAMPLES)
@given(header=st.data(), cut=st.integers(0, 64))
def test_a_safetensors_header_of_random_bytes_gives_a_shard_error(
    made: Path, header: st.DataObject, cut: int
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = _scratch(made, tmp)
        name = "model-00000.safetensors"
        old = (ckpt / name).read_bytes()
        (length,) = struct.unpack("<Q", old[:8])
        head = header.draw(contents(old[8 : 8 + length]), label="header")
        declared = max(0, len(head) + cut % 9 - 4) if cut < 32 else len(head)  # sometimes a wrong length
        new = struct.pack("<Q", declared) + head + old[8 + length :]
        forge(ckpt, name, new, store.MANIFEST)

        def read() -> None:
            shard = shards.ShardFile(ckpt / name)
            shard.close()
            index = shards.read_index(ckpt)
            for tensor in index["tensors"]:
                shards.read_tensor(ckpt, index, tensor)

        outcome(read, CKPT_ERRORS)


@pytest.mark.parametrize("name", EXPORT_FILES)
@fuzz(FILE_EXAMPLES)
@given(data=st.data())
def test_an_export_file_of_random_bytes_gives_a_checkpoint_error(
    made: Path, name: str, data: st.DataObject
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "checkpoint"
        shutil.copytree(made / "checkpoint", out)
        new = drawn(data, name, (out / name).read_bytes())
        if name == export.META:
            (out / name).write_bytes(new)
        else:
            forge(out, name, new, export.META)
        outcome(lambda: export.load_export(out), CKPT_ERRORS)


@pytest.fixture(scope="module")
def exports(made: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The run's own export and its HF and CTranslate2 exports (``tpe-ckpt export --format``), by format."""
    found, folder = {"native": made / "checkpoint"}, tmp_path_factory.mktemp("fuzz-exports")
    for fmt in ("hf", "ctranslate2"):
        found[fmt] = folder / fmt
        assert ckpt_cli.main(["export", str(made), "--out", str(found[fmt]), "--format", fmt]) == 0
    return found


def replace_output(out: Path, fmt: str) -> None:
    """What reads an export's marker: a later export to the same ``--out`` (``check_output``), and
    ``tpe-eval --out`` adding its files to a native export (``record``)."""
    if fmt == "native":
        export.check_export_out(out, ckpt_commands.COMMAND)
        record(out, ["eval.json"], "tpe-eval")
    else:
        check_output(out, ckpt_commands.COMMAND, export.KINDS[fmt], protected=RunDir.what)


@pytest.mark.parametrize("fmt", export.KINDS)
@fuzz(MARKER_EXAMPLES)
@given(data=st.data())
@example(data=None).via("a marker whose 'also' is a number")
def test_an_export_marker_of_random_bytes_gives_an_output_refused(
    exports: dict[str, Path], fmt: str, data: st.DataObject | None
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / fmt
        shutil.copytree(exports[fmt], out)
        real = (out / MARKER).read_bytes()
        new = (
            json.dumps({**json.loads(real), "also": 1}).encode()
            if data is None
            else drawn(data, MARKER, real)
        )
        (out / MARKER).write_bytes(new)
        outcome(lambda: replace_output(out, fmt), (OutputRefused,))


@pytest.mark.parametrize("where", ["manifest", "index", "meta"])
def test_a_file_name_holding_a_lone_surrogate_is_refused_before_any_open(made: Path, where: str) -> None:
    """JSON can escape a lone surrogate (``"\\ud800"``), which no file name can hold: the readers refuse
    the name as they refuse ``..``, rather than fail inside ``os.open`` with ``UnicodeEncodeError``."""
    bad = "model\ud800.safetensors"
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = _scratch(made, tmp)
        out = Path(tmp) / "checkpoint"
        shutil.copytree(made / "checkpoint", out)
        if where == "manifest":
            manifest = json.loads((ckpt / store.MANIFEST).read_text())
            manifest["files"][bad] = {"size": 1, "sha256": "0" * 64}
            (ckpt / store.MANIFEST).write_text(json.dumps(manifest))
        elif where == "index":
            index = json.loads((ckpt / shards.INDEX).read_text())
            next(iter(index["tensors"].values()))["chunks"][0]["file"] = bad
            forge(ckpt, shards.INDEX, json.dumps(index).encode(), store.MANIFEST)
        else:
            meta = json.loads((out / export.META).read_text())
            meta["sha256"][bad] = "0" * 64
            (out / export.META).write_text(json.dumps(meta))
        read = (lambda: export.load_export(out)) if where == "meta" else (lambda: read_checkpoint(ckpt))
        with pytest.raises(CKPT_ERRORS) as caught:
            read()
        assert type(caught.value) in CKPT_ERRORS
        assert "lone surrogate" in str(caught.value)


def test_the_example_count_is_what_the_docs_say() -> None:
    """docs/reliability.md states the number of random examples these tests run."""
    docs = (Path(__file__).parents[1] / "docs" / "reliability.md").read_text()
    assert f"{EXAMPLES + DATA_EXAMPLES + FIGURES_EXAMPLES:,} random examples" in docs
