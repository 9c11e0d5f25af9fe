"""Line-aligned text files read as bytes, in pieces, with lines ended at ``\\n`` only.

Text mode would also end a line at a lone ``\\r`` (and ``str.splitlines`` at U+0085 or U+2028), which
shifts every later pair of a corpus by one line. Here a line ends at ``\\n`` alone; a ``\\r`` just
before it (a CRLF file) belongs to the line ending, a ``\\r`` anywhere else stays in the text (the
cleaning turns it into a space). A byte-order mark at the start of a file is dropped. Plain files
are counted first, so that two sides of different lengths fail before any pair is read (a stream of
compressed files compares them as it reads). A ``.gz`` file that is not a whole gzip stream (cut short,
damaged, or plain text under a ``.gz`` name) stops with a ``CorpusError`` naming it.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import os
import zlib
from collections.abc import Iterator
from itertools import zip_longest
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa

from tpe_train.data.errors import CorpusError

BOM = b"\xef\xbb\xbf"
CHUNK = 1 << 22  # bytes read at a time when counting


def open_binary(path: Path) -> BinaryIO:
    """The bytes of ``path``, decompressed when its name ends in ``.gz``."""
    if path.name.endswith(".gz"):
        return io.BufferedReader(gzip.GzipFile(path, "rb"), buffer_size=CHUNK)
    return open(path, "rb", buffering=CHUNK)


@contextlib.contextmanager
def reading(path: Path) -> Iterator[BinaryIO]:
    """``open_binary(path)``, where a damaged gzip stream stops with a ``CorpusError`` naming the file."""
    try:
        with open_binary(path) as f:
            yield f
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise CorpusError(
            f"{path} is not a whole gzip file ({err or type(err).__name__}): it is cut short or damaged, or "
            f"plain text under a .gz name; check it with `gzip -t {path}`, then copy or compress it again "
            "(or drop .gz from the name of a plain text file)"
        ) from None


def raw_lines(path: Path) -> Iterator[bytes]:
    """The lines of ``path`` as bytes, without ``\\n`` (nor the ``\\r`` of a ``\\r\\n``), BOM dropped."""
    with reading(path) as f:
        for number, line in enumerate(f):
            if number == 0 and line.startswith(BOM):
                line = line[len(BOM) :]
            if line.endswith(b"\n"):
                line = line[:-2] if line.endswith(b"\r\n") else line[:-1]
            yield line


def count_lines(path: Path) -> int:
    """Lines of ``path``, as ``raw_lines`` yields them (a last line without ``\\n`` counts)."""
    lines, last = 0, b"\n"
    with reading(path) as f:
        while chunk := f.read(CHUNK):
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    return lines + (last != b"\n")


def decode(line: bytes, path: Path, number: int, bad_utf8: str) -> str:
    """One line as text; bytes that are not UTF-8 stop with the file and line (or become U+FFFD)."""
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as err:
        if bad_utf8 == "replace":
            return line.decode("utf-8", errors="replace")
        raise CorpusError(
            f"{path} line {number} is not UTF-8 (byte {line[err.start]:#04x} at column {err.start + 1}); "
            "convert the file to UTF-8 (iconv -f <encoding> -t UTF-8), or set data.bad_utf8=replace "
            "to substitute U+FFFD"
        ) from None


def check_aligned(src: Path, tgt: Path, compressed: bool = True) -> None:
    """Stop now when two files have different line counts. ``compressed=False`` counts plain files
    only (a stream compares compressed ones as it reads them, rather than decompress them twice)."""
    if not compressed and (src.name.endswith(".gz") or tgt.name.endswith(".gz")):
        return
    ns, nt = count_lines(src), count_lines(tgt)
    if ns != nt:
        raise CorpusError(
            f"{src} has {ns} lines but {tgt} has {nt}; the files of a text corpus must be line-aligned "
            "(one segment per line on both sides; `tpe-data check` lists the problems of each file)"
        )


def line_pairs(src: str, tgt: str, bad_utf8: str = "error", stamp: str = "") -> Iterator[dict[str, str]]:
    """Aligned lines of two files as ``{"src", "tgt"}`` records, read lazily.

    ``stamp`` (sizes and modification times) only makes a cached copy of the result follow the files.
    """
    del stamp
    src_path, tgt_path = Path(src), Path(tgt)
    number = 0
    for number, (s, t) in enumerate(zip_longest(raw_lines(src_path), raw_lines(tgt_path)), start=1):
        if s is None or t is None:
            short, other = (src_path, tgt_path) if s is None else (tgt_path, src_path)
            raise CorpusError(
                f"{short} ends at line {number - 1} but {other} goes on; the files of a text corpus "
                "must be line-aligned (one segment per line on both sides)"
            )
        yield {"src": decode(s, src_path, number, bad_utf8), "tgt": decode(t, tgt_path, number, bad_utf8)}


def write_arrow(pairs: Iterator[dict[str, str]], path: Path, rows: int = 20_000) -> None:
    """Pairs into an Arrow stream file at ``path`` (what ``datasets.Dataset.from_file`` maps), written
    ``rows`` at a time."""
    schema = pa.schema([("src", pa.string()), ("tgt", pa.string())])

    def batch(src: list[str], tgt: list[str]) -> pa.RecordBatch:
        return pa.record_batch([pa.array(src, pa.string()), pa.array(tgt, pa.string())], schema=schema)

    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        src: list[str] = []
        tgt: list[str] = []
        for pair in pairs:
            src.append(pair["src"])
            tgt.append(pair["tgt"])
            if len(src) == rows:
                writer.write_batch(batch(src, tgt))
                src, tgt = [], []
        if src:
            writer.write_batch(batch(src, tgt))


def stamp(*paths: Path) -> str:
    """Size, modification time and a hash of the first and last MiB of each of ``paths``: changes when
    a file does (also when rewritten within the file system's clock tick)."""
    parts = []
    for path in paths:
        info = path.stat()
        digest = hashlib.blake2b(digest_size=8)
        with open(path, "rb") as f:
            digest.update(f.read(1 << 20))
            if info.st_size > 2 << 20:
                f.seek(-(1 << 20), os.SEEK_END)
                digest.update(f.read())
        parts.append(f"{path}:{info.st_size}:{info.st_mtime_ns}:{digest.hexdigest()}")
    return ";".join(parts)
