"""Hypothesis strategies and helpers of the reader fuzz tests (tests/test_reader_fuzz*.py): random bytes,
random JSON, a real file's JSON with one value replaced, damaged gzip and parquet files, and ``outcome``,
which lets only the project's own error classes (by exact class) out of a reader."""

from __future__ import annotations

import gzip
import json
import struct
from collections.abc import Callable, Iterator
from typing import Any

from hypothesis import event, settings
from hypothesis import strategies as st


def fuzz(examples: int) -> settings:
    """Hypothesis settings: ``examples`` examples, the same ones each run, no time limit per example."""
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None)


# -- random contents ---------------------------------------------------------------------------------
SPECIAL = [
    b"\n",
    b"\r",
    b"\r\n",
    b"\x00",
    b"\xef\xbb\xbf",  # a byte-order mark
    b"\xed\xa0\x80",  # an encoded lone surrogate
    b"\xff",
    b"\xc3",  # a truncated two-byte sequence
    b"\x1f\x8b\x08\x00",  # a gzip header
    b"caf\xc3\xa9",
    b"line",
]
pieces = st.lists(st.sampled_from(SPECIAL) | st.binary(max_size=8), max_size=24).map(b"".join)
raw = st.binary(max_size=300) | pieces


@st.composite
def gzipped(draw: st.DrawFn) -> bytes:
    """A gzip stream of random text, cut short, with a byte flipped, or with bytes appended."""
    whole = gzip.compress(draw(pieces), mtime=0)
    how = draw(st.sampled_from(["whole", "cut", "flip", "tail", "header"]))
    if how == "cut":
        return whole[: draw(st.integers(0, len(whole) - 1))]
    if how == "flip":
        at = draw(st.integers(0, len(whole) - 1))
        return whole[:at] + bytes([whole[at] ^ draw(st.integers(1, 255))]) + whole[at + 1 :]
    if how == "tail":
        return whole + draw(st.binary(min_size=1, max_size=16))
    if how == "header":
        return b"\x1f\x8b" + draw(st.binary(max_size=40))
    return whole


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=16,
)


def _paths(value: Any, prefix: tuple[Any, ...] = (), depth: int = 0) -> Iterator[tuple[Any, ...]]:
    """Every place inside ``value`` (keys and list positions), down to ``depth`` 4."""
    if depth > 4:
        return
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        yield (*prefix, key)
        yield from _paths(inner, (*prefix, key), depth + 1)


@st.composite
def mutated(draw: st.DrawFn, original: Any) -> bytes:
    """``original`` with one value (or a key's name) replaced by random JSON, as bytes."""
    value = json.loads(json.dumps(original))
    places = list(_paths(value))
    if not places:
        return json.dumps(draw(json_values)).encode()
    place = draw(st.sampled_from(places))
    holder = value
    for key in place[:-1]:
        holder = holder[key]
    if isinstance(holder, dict) and draw(st.booleans()):
        holder[draw(st.text(max_size=12))] = holder.pop(place[-1])
    else:
        holder[place[-1]] = draw(json_values)
    return json.dumps(value).encode()


def contents(original: bytes) -> st.SearchStrategy[bytes]:
    """Random replacements for a file whose real contents are ``original``."""
    options = raw | json_values.map(lambda v: json.dumps(v).encode())
    try:
        options = options | mutated(json.loads(original))
    except ValueError:
        options = options | st.builds(lambda cut: original[:cut], st.integers(0, len(original)))
    return options


def drawn(data: st.DataObject, name: str, original: bytes) -> bytes:
    return data.draw(contents(original), label=name)


def outcome(read: Callable[[], Any], allowed: tuple[type[Exception], ...]) -> str:
    """``read()``'s result kind: "read", or the name of an allowed error class (any other escapes)."""
    try:
        read()
    except Exception as err:
        assert type(err) in allowed, f"{type(err).__name__}: {err}"
        assert str(err), "an error without a message"
        event(type(err).__name__)  # shown by pytest --hypothesis-show-statistics
        return type(err).__name__
    event("read")
    return "read"


def parquet_bytes(columns: dict[str, list[Any]], row_group_size: int | None = None) -> bytes:
    """A parquet file of ``columns``, as bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(pa.table(columns), sink, row_group_size=row_group_size)
    return bytes(sink.getvalue().to_pybytes())


PARQUET = parquet_bytes({"src": ["ein haus", "die katze"], "tgt": ["a house", "the cat"]})


@st.composite
def damaged_parquet(draw: st.DrawFn, original: bytes = PARQUET) -> bytes:
    """A real parquet file cut short, with bytes overwritten anywhere or in a page (``damaged_page``), or
    random bytes between the magic."""
    how = draw(st.sampled_from(["cut", "overwrite", "page", "magic"]))
    if how == "cut":
        return original[: draw(st.integers(0, len(original) - 1))]
    if how == "overwrite":
        return draw(overwritten(original))
    if how == "page":
        return draw(damaged_page(original))
    return b"PAR1" + draw(raw) + b"PAR1"


@st.composite
def damaged_page(draw: st.DrawFn, original: bytes) -> bytes:
    """A real parquet file with up to 12 bytes overwritten between the magic and the footer: the footer
    reads, and a page (its header, levels or values) is damaged."""
    (footer,) = struct.unpack("<I", original[-8:-4])
    end = len(original) - 8 - footer  # where the footer starts
    at = draw(st.integers(4, end - 1))
    patch = draw(st.binary(min_size=1, max_size=min(12, end - at)))
    return original[:at] + patch + original[at + len(patch) :]


@st.composite
def overwritten(draw: st.DrawFn, original: bytes) -> bytes:
    """``original`` with up to 12 bytes overwritten somewhere (a binary file's damage that keeps its size)."""
    at = draw(st.integers(0, len(original) - 1))
    patch = draw(st.binary(min_size=1, max_size=12))
    return original[:at] + patch + original[at + len(patch) :]


def message(read: Callable[[], Any], allowed: tuple[type[Exception], ...]) -> str:
    """``outcome(read, allowed)``, then the allowed error's message ("" when ``read()`` read)."""
    said: list[str] = []

    def keep() -> None:
        try:
            read()
        except Exception as err:
            said.append(str(err))
            raise

    outcome(keep, allowed)
    return said[0] if said else ""
