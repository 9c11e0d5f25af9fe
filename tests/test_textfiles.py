"""Text corpora end a line at ``\\n`` only: a stray ``\\r``, U+0085 or U+2028 inside a line, a CRLF file
and a byte-order mark never shift the pairs; misaligned files fail before a pair is read."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from tpe_train.data.errors import CorpusError
from tpe_train.data.lengths import fits
from tpe_train.data.sources import SourceSpec, load_split, stream_split
from tpe_train.data.textfiles import count_lines, raw_lines

SRC = "one\rstill one\nnext line two\u2028same\nthree \u0085 same\n"
TGT = "\ufeffeins\r\nzwei\r\ndrei\r\n"  # a BOM and CRLF endings
WANT = [("one\rstill one", "eins"), ("next line two\u2028same", "zwei"), ("three \u0085 same", "drei")]


def _spec(path: Path) -> SourceSpec:
    return SourceSpec(kind="text", src_lang="en", tgt_lang="de", path=str(path))


@pytest.mark.parametrize("gz", [False, True])
def test_lines_end_at_newline_only_in_prepared_and_streamed_reads(tmp_path: Path, gz: bool) -> None:
    (tmp_path / "train.en").write_bytes(SRC.encode())
    tgt = TGT.encode()
    if gz:
        (tmp_path / "train.de.gz").write_bytes(gzip.compress(tgt))
    else:
        (tmp_path / "train.de").write_bytes(tgt)
    loaded = load_split(_spec(tmp_path), "train")
    assert list(zip(loaded["src"], loaded["tgt"], strict=True)) == WANT
    assert [(r["src"], r["tgt"]) for r in stream_split(_spec(tmp_path), "train")] == WANT


def test_a_changed_file_is_read_again_not_taken_from_the_cache(tmp_path: Path) -> None:
    (tmp_path / "train.en").write_text("a\nb\n")
    (tmp_path / "train.de").write_text("A\nB\n")
    assert load_split(_spec(tmp_path), "train")["src"] == ["a", "b"]
    (tmp_path / "train.en").write_text("x\ny\n")
    assert load_split(_spec(tmp_path), "train")["src"] == ["x", "y"]


def test_counts_match_the_lines_read(tmp_path: Path) -> None:
    for text in (b"", b"a", b"a\n", b"a\r\nb", b"a\rb\n\n", b"\xef\xbb\xbfa\nb\n"):
        path = tmp_path / "f"
        path.write_bytes(text)
        assert count_lines(path) == len(list(raw_lines(path))), text


def test_misaligned_plain_and_compressed_files_fail_before_any_pair(tmp_path: Path) -> None:
    (tmp_path / "train.en").write_text("a\nb\nc\n")
    (tmp_path / "train.de.gz").write_bytes(gzip.compress(b"A\rB\nC\n"))  # the \r is no line end
    with pytest.raises(CorpusError, match=r"train.en has 3 lines but \S*train.de.gz has 2"):
        load_split(_spec(tmp_path), "train")
    (tmp_path / "train.de.gz").unlink()
    (tmp_path / "train.de").write_text("A\rB\nC\n")
    with pytest.raises(CorpusError, match="has 3 lines but"):
        stream_split(_spec(tmp_path), "train")  # at set-up, not after reading


def test_bad_bytes_name_the_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "train.en").write_bytes(b"a\nb\xff\n")
    (tmp_path / "train.de").write_text("A\nB\n")
    with pytest.raises(CorpusError, match=r"train.en line 2 is not UTF-8 \(byte 0xff at column 2\)"):
        load_split(_spec(tmp_path), "train")


def test_fits_is_one_rule_for_numbers_and_arrays() -> None:
    import numpy as np

    assert fits(3, 4, 4) and not fits(5, 1, 4)
    assert fits(np.array([1, 5, 4]), np.array([4, 1, 5]), 4).tolist() == [True, False, False]
