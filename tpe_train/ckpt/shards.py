"""Sharded tensors on disk: every rank writes the pieces of the global tensors that it holds, with an
index of which region of which global tensor each piece is; any layout reads back only what it needs.

A rank's piece of a global (single-device) tensor is a *region*: the elements ``[start, stop)`` of the
row-major flattening of a rectangular block of it. The block is the rank's tensor-parallel slice (the
whole tensor without tensor parallelism); the range is its ZeRO fragment (ZeRO-1/2: where the flat
partition cuts the parameter, ZeRO-3: the parameter's own partition) or, for state that several ranks
hold alike, this rank's share of the writing. Such a range is the union of a few rectangular chunks (a
part of a row, whole rows, a part of a row; recursively in more dimensions), each a contiguous stretch
of the range. Chunks are what is stored, one safetensors tensor each, and what
``torch.distributed.checkpoint``'s resharding planner (``create_read_items_for_chunk_list``) intersects
with the chunks a rank of another layout needs.

Files are safetensors, written here as a stream (one chunk at a time, hashed while written, so that the
manifest needs no second pass over the data) and read back with plain reads of the bytes a region needs
(no memory map whose pages would stay resident). ``index.json`` lists every chunk of every tensor:
nothing on the load path unpickles anything. DCP's own storage layer does not give that: its
``FileSystemReader`` unpickles the ``.metadata`` file (plain ``pickle.load``) and every tensor
(``torch.load``), and its safetensors variant (``HuggingFaceStorageWriter``) keys a file's tensors by
name, one chunk per tensor and file, where a ZeRO fragment is several chunks of one tensor.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import Tensor

from tpe_train.ckpt.store import CheckpointError, read_manifest, verify
from tpe_train.run import members

INDEX = "index.json"
MAX_HEADER = 100 * members.MIB  # the largest safetensors header read (safetensors' own limit)
FORMAT = "tpe-train-shards/1"
DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.bfloat16: "BF16", torch.float16: "F16"}
_TORCH = {name: dtype for dtype, name in DTYPES.items()}

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


class ShardError(CheckpointError):
    """A sharded checkpoint cannot serve what is asked of it (the message names file and tensor)."""


def split_range(sizes: tuple[int, ...], lo: int, hi: int) -> list[tuple[Box, int, int]]:
    """Rectangular chunks covering elements ``[lo, hi)`` of a row-major array of shape ``sizes``, in
    order: ``((offsets, chunk sizes), first, end)``, where ``[first, end)`` is the chunk's stretch of
    the flat range. At most ``2 * len(sizes) - 1`` chunks."""
    if lo >= hi:
        return []
    if not sizes:
        return [(((), ()), lo, hi)]
    inner = math.prod(sizes[1:])
    full_lo, full_hi = -(-lo // inner), hi // inner  # whole rows [full_lo, full_hi)

    def within(row: int, a: int, b: int) -> list[tuple[Box, int, int]]:
        base = row * inner
        return [
            (((row, *o), (1, *s)), base + x, base + y)
            for (o, s), x, y in split_range(sizes[1:], a - base, b - base)
        ]

    if full_lo > full_hi:  # inside one row
        return within(lo // inner, lo, hi)
    out = within(full_lo - 1, lo, full_lo * inner) if lo < full_lo * inner else []
    if full_hi > full_lo:
        rest = (0,) * (len(sizes) - 1)
        out.append((((full_lo, *rest), (full_hi - full_lo, *sizes[1:])), full_lo * inner, full_hi * inner))
    if hi > full_hi * inner:
        out += within(full_hi, full_hi * inner, hi)
    return out


@dataclass(frozen=True)
class Region:
    """Elements ``[start, stop)`` of the row-major flattening of the block ``offsets + sizes`` of the
    global tensor ``name`` of shape ``shape``."""

    name: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int
    stop: int

    @classmethod
    def whole(cls, name: str, shape: tuple[int, ...]) -> Region:
        return cls(name, shape, (0,) * len(shape), shape, 0, math.prod(shape))

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def part(self, index: int, count: int) -> Region:
        """The ``index``-th of ``count`` near-equal parts of the range (how replicas share the writing)."""
        n = self.numel
        lo, hi = self.start + n * index // count, self.start + n * (index + 1) // count
        return Region(self.name, self.shape, self.offsets, self.sizes, lo, hi)

    def chunks(self) -> list[tuple[Box, int, int]]:
        """The region's rectangular chunks in global coordinates, with their stretch ``[first, end)`` of
        the region's own flat data (0 = the element at ``start``)."""
        out = []
        for (o, s), lo, hi in split_range(self.sizes, self.start, self.stop):
            offsets = tuple(a + b for a, b in zip(self.offsets, o, strict=True))
            out.append(((offsets, s), lo - self.start, hi - self.start))
        return out


def chunk_key(name: str, offsets: tuple[int, ...]) -> str:
    return f"{name}@{','.join(map(str, offsets))}"


def write_safetensors(
    path: Path,
    items: Iterable[tuple[str, Tensor]],
    shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype = torch.float32,
    metadata: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Write tensors as one safetensors file, one at a time, in the order of ``shapes`` (which gives
    every key's shape up front: the header comes first). ``items`` yields ``(key, tensor)`` in that
    order; each tensor is cast to ``dtype`` on its own. Returns the file's size and SHA-256."""
    width = torch.tensor([], dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key, shape in shapes.items():
        size = math.prod(shape) * width
        header[key] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        _emit(f, digest, struct.pack("<Q", len(text)) + text)
        for (key, tensor), expected in zip(items, shapes, strict=True):
            assert key == expected and tuple(tensor.shape) == shapes[key], (key, expected)
            data = tensor.detach().to("cpu", dtype).contiguous()
            _emit(
                f, digest, data.reshape(-1).view(torch.uint8).numpy().data if data.numel() else b""
            )  # 0-d too
        f.flush()
        os.fsync(f.fileno())
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def _emit(f: BinaryIO, digest: Any, data: Any) -> None:
    f.write(data)
    digest.update(data)


class ShardFile:
    """One safetensors file, read by plain reads of the rows a request covers."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = members.open_member(path.parent, path.name, members.ANY_SIZE, ShardError)
        self.file = os.fdopen(fd, "rb")
        try:
            self.header = self._header()
        except BaseException:
            self.file.close()
            raise
        self.base = 8 + self.length

    def _header(self) -> dict[str, Any]:
        self.size = size = os.fstat(self.file.fileno()).st_size
        head = self.file.read(8)
        (self.length,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
        if not 0 <= self.length <= min(size - 8, MAX_HEADER):
            raise ShardError(
                f"{self.path} declares a header of {self.length:,} bytes in a file of {size:,} (at most "
                f"{MAX_HEADER // members.MIB} MiB): it is not a safetensors file; {members.FIX}"
            )
        try:
            header = members.loads(self.file.read(self.length))
        except ValueError as err:
            raise ShardError(f"{self.path} has an unreadable header ({err}); {members.FIX}") from None
        members.check_type(header, dict, f"{self.path}'s header", ShardError)
        header.pop("__metadata__", None)
        for key, info in header.items():
            where = f"{self.path}: tensor {key!r}"
            members.check_type(info, dict, where, ShardError)
            members.check_type(info.get("dtype"), str, f"{where} dtype", ShardError)
            if info["dtype"] not in _TORCH:
                raise ShardError(f"{where} has dtype {info['dtype'][:20]!r}, not one of {sorted(_TORCH)}")
            _ints(info.get("shape"), f"{where} shape")
            _ints(info.get("data_offsets"), f"{where} data_offsets", 2)
        at = 0  # the tensors' bytes lie one after another and fill the data, as safetensors requires
        for first, end, key in sorted((*info["data_offsets"], key) for key, info in header.items()):
            if first != at or end < first:
                raise ShardError(
                    f"{self.path}: tensor {key[:200]!r} spans the bytes {first}-{end} of the data, where "
                    f"the tensors before it end at {at}; {members.FIX}"
                )
            at = end
        if at != size - 8 - self.length:
            raise ShardError(
                f"{self.path} holds {size - 8 - self.length:,} bytes after its header, where its tensors "
                f"span {at:,}; {members.FIX}"
            )
        return dict(header)

    def read(self, key: str, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> Tensor:
        """The sub-block ``offsets + lengths`` of tensor ``key``: only the rows it spans are read."""
        info = self.header.get(key)
        if info is None:
            raise ShardError(f"{self.path} holds no tensor {key}; the index and the file disagree")
        dtype, shape = _TORCH[info["dtype"]], tuple(info["shape"])
        first, end = info["data_offsets"]
        width = torch.tensor([], dtype=dtype).element_size()
        if end - first != math.prod(shape) * width or self.base + end > os.fstat(self.file.fileno()).st_size:
            raise ShardError(
                f"{self.path}: tensor {key} spans bytes {first}-{end}, which do not hold its shape "
                f"{list(shape)} inside the file; {members.FIX}"
            )
        if not shape:
            rows, start, count = (), 0, 1
        else:
            inner = math.prod(shape[1:])
            rows, start, count = (lengths[0], *shape[1:]), offsets[0] * inner, lengths[0] * inner
        out = torch.empty(rows, dtype=dtype)
        width = out.element_size()
        self.file.seek(self.base + info["data_offsets"][0] + start * width)
        got = self.file.readinto(out.reshape(-1).view(torch.uint8).numpy().data) if count else 0
        if got != count * width:
            raise ShardError(f"{self.path} ends inside tensor {key}; the file is truncated")
        if not shape:
            return out
        return out[(slice(None), *(slice(o, o + n) for o, n in zip(offsets[1:], lengths[1:], strict=True)))]

    def close(self) -> None:
        self.file.close()


@dataclass
class Piece:
    """A region this rank writes, and its data: 1-D, ``region.numel`` elements."""

    region: Region
    data: Tensor


def save_pieces(directory: Path, stem: str, pieces: list[Piece]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write ``pieces`` to ``<directory>/<stem>.safetensors``; returns the file's index entries
    (tensor name -> shape and chunks) and its size and hash (nothing written for no pieces)."""
    file = f"{stem}.safetensors"
    shapes: dict[str, tuple[int, ...]] = {}
    index: dict[str, Any] = {}
    views: list[tuple[str, Tensor]] = []
    for piece in pieces:
        entry = index.setdefault(piece.region.name, {"shape": list(piece.region.shape), "chunks": []})
        for (offsets, sizes), lo, hi in piece.region.chunks():
            key = chunk_key(piece.region.name, offsets)
            shapes[key] = sizes
            views.append((key, piece.data[lo:hi].view(sizes)))
            entry["chunks"].append({"file": file, "key": key, "offsets": list(offsets), "sizes": list(sizes)})
    if not views:
        return {}, {}
    return index, {file: write_safetensors(directory / file, iter(views), shapes)}


def merge_index(parts: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One index from every rank's entries (``index.json``)."""
    tensors: dict[str, Any] = {}
    for part in parts:
        for name, entry in part.items():
            merged = tensors.setdefault(name, {"shape": entry["shape"], "chunks": []})
            if merged["shape"] != entry["shape"]:
                raise ShardError(
                    f"ranks disagree on the shape of {name}: {merged['shape']} and {entry['shape']}"
                )
            merged["chunks"] += entry["chunks"]
    return {"format": FORMAT, "dtype": "F32", "tensors": dict(sorted(tensors.items()))}


@dataclass
class Read:
    """One copy: a sub-block of a stored chunk into a sub-block of a destination chunk."""

    file: str
    key: str
    src: tuple[tuple[int, ...], tuple[int, ...]]  # offsets in the stored chunk, lengths
    dst: Tensor  # the destination view, of shape lengths


class Plan:
    """The reads that fill a list of (region, 1-D destination) from a checkpoint's shards."""

    def __init__(self, directory: Path, index: dict[str, Any], wanted: list[tuple[Region, Tensor]]) -> None:
        self.directory, self.reads = directory, []
        tensors = index["tensors"]
        for region, dest in wanted:
            entry = tensors.get(region.name)
            if entry is None:
                raise ShardError(
                    f"{directory / INDEX} has no tensor {region.name}; the checkpoint is of another model"
                )
            if tuple(entry["shape"]) != region.shape:
                raise ShardError(
                    f"{region.name} has shape {tuple(entry['shape'])} in {directory}, {region.shape} here; "
                    "the checkpoint is of another model"
                )
            self.reads += _reads(entry, region, dest, str(directory))

    @property
    def files(self) -> list[str]:
        return sorted({r.file for r in self.reads})

    def run(self) -> None:
        """Do the reads, file by file, in file order."""
        by_file: dict[str, list[Read]] = {}
        for read in self.reads:
            by_file.setdefault(read.file, []).append(read)
        for name, reads in by_file.items():
            members.check_name(name, self.directory / INDEX, error=ShardError)
            f = ShardFile(self.directory / name)
            try:
                with torch.no_grad():  # the destinations may be views of leaves that require grad
                    for read in reads:
                        read.dst.copy_(f.read(read.key, *read.src))
            finally:
                f.close()


def _reads(entry: dict[str, Any], region: Region, dest: Tensor, where: str) -> list[Read]:
    # Imported here, not at the top: torch.distributed.checkpoint costs about a second of start-up
    # (it pulls in DTensor and FSDP), and only a load that reads stored chunks needs it.
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    assert dest.numel() == region.numel, (region, dest.shape)
    size = torch.Size(entry["shape"])
    stored = [ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"])) for c in entry["chunks"]]
    metadata = TensorStorageMetadata(TensorProperties(dtype=torch.float32), size, stored)
    chunks = region.chunks()
    local = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for (o, s), _, _ in chunks]
    covered = [0] * len(chunks)
    out = []
    for item in create_read_items_for_chunk_list(region.name, metadata, local):
        mine, theirs = item.dest_index.index, item.storage_index.index  # positions in local and stored
        assert mine is not None and theirs is not None
        (_, sizes), lo, hi = chunks[mine]
        chunk = entry["chunks"][theirs]
        view = dest[lo:hi].view(sizes)[
            tuple(slice(o, o + n) for o, n in zip(item.dest_offsets, item.lengths, strict=True))
        ]
        out.append(
            Read(chunk["file"], chunk["key"], (tuple(item.storage_offsets), tuple(item.lengths)), view)
        )
        covered[mine] += math.prod(item.lengths)
    for ((offsets, sizes), _, _), got in zip(chunks, covered, strict=True):
        if got != math.prod(sizes):
            raise ShardError(
                f"the shards in {where} do not cover {region.name}[{offsets} + {sizes}] ({got} of "
                f"{math.prod(sizes)} elements); the checkpoint is incomplete"
            )
    return out


def dump_index(index: dict[str, Any]) -> str:
    """``index.json``'s text: one line per tensor, so that it reads (and diffs) by tensor."""
    head = {k: v for k, v in index.items() if k != "tensors"}
    lines = [
        f"  {json.dumps(name)}: {json.dumps(entry, separators=(',', ':'))}"
        for name, entry in index["tensors"].items()
    ]
    return json.dumps(head)[:-1] + ', "tensors": {\n' + ",\n".join(lines) + "\n}}\n"


def read_index(directory: Path, files: bool = True) -> dict[str, Any]:
    """A checkpoint's index, checked against its manifest and (``files``) every chunk against the
    safetensors header of its file (``check_files``), before any tensor is read. A checkpoint of the
    first format (every tensor whole, in ``model.safetensors`` and ``optimizer.safetensors``) gets one
    made from the files' headers: each tensor is then a single chunk."""
    if (directory / INDEX).exists() or not (directory / "model.safetensors").exists():
        verify(directory, [INDEX])
        index = members.read_json(directory, INDEX, {"tensors": dict}, error=ShardError)
        return _checked_index(directory, index, files)
    tensors = {}
    for name in ("model.safetensors", "optimizer.safetensors"):
        f = ShardFile(directory / name)
        f.close()
        for key, info in f.header.items():
            chunk = {"file": name, "key": key, "offsets": [0] * len(info["shape"]), "sizes": info["shape"]}
            tensors[key] = {"shape": info["shape"], "chunks": [chunk]}
    return {"format": "tpe-train-checkpoint/1", "dtype": "F32", "tensors": tensors}


def _ints(value: Any, where: str, count: int | None = None) -> list[int]:
    """A list of non-negative integers (``count`` of them, when given)."""
    members.check_type(value, list, where, ShardError)
    for item in value:
        members.check_type(item, int, f"{where} item", ShardError)
        if item < 0:
            raise ShardError(f"{where} holds {item}, a negative number; {members.FIX}")
    if count is not None and len(value) != count:
        raise ShardError(f"{where} has {len(value)} numbers, {count} expected; {members.FIX}")
    return list(value)


def _checked_index(directory: Path, index: dict[str, Any], files: bool) -> dict[str, Any]:
    """``index.json`` with the types its readers rely on; every chunk file a plain name of the
    checkpoint that its manifest lists; its dtype one of the format's; every chunk inside its tensor
    under the key written for it (the tensor's name and offsets), and a tensor's chunks as many
    elements as its shape; with ``files``, every chunk what its file's header holds (``check_files``)."""
    where = directory / INDEX
    listed = read_manifest(directory)["files"]
    dtype = index.get("dtype")
    if not isinstance(dtype, str) or dtype not in _TORCH:
        raise ShardError(
            f"{where} gives the dtype {str(dtype)[:20]!r}, not one of {sorted(_TORCH)}; {members.FIX}"
        )
    for name, entry in index["tensors"].items():
        members.check_type(entry, dict, f"{where}: tensor {name!r}", ShardError)
        shape = _ints(entry.get("shape"), f"{where}: {name} shape")
        members.check_type(entry.get("chunks"), list, f"{where}: {name} chunks", ShardError)
        for chunk in entry["chunks"]:
            members.check_type(chunk, dict, f"{where}: a chunk of {name}", ShardError)
            members.check_name(chunk.get("file"), where, listed, error=ShardError)
            members.check_type(chunk.get("key"), str, f"{where}: a chunk key of {name}", ShardError)
            _ints(chunk.get("offsets"), f"{where}: a chunk of {name} offsets", len(shape))
            _ints(chunk.get("sizes"), f"{where}: a chunk of {name} sizes", len(shape))
            _check_place(where, name, shape, chunk)
        stored = sum(math.prod(c["sizes"]) for c in entry["chunks"])
        if stored != math.prod(shape):
            raise ShardError(
                f"{where}: the chunks of {name} hold {stored:,} elements, where its shape {shape} has "
                f"{math.prod(shape):,}: a chunk is missing or listed twice; {_disagree(where)}"
            )
    if files:
        check_files(directory, index)
    return index


def _check_place(where: Path, name: str, shape: list[int], chunk: dict[str, Any]) -> None:
    """A chunk of ``index.json`` (``where``) lies inside its tensor, under the key written for it."""
    offsets, sizes, key = chunk["offsets"], chunk["sizes"], chunk["key"][:200]
    outside = [d for d, (o, n, s) in enumerate(zip(offsets, sizes, shape, strict=True)) if o + n > s]
    if outside:
        raise ShardError(
            f"{where}: the chunk {key!r} of {name} spans offsets {offsets} + sizes {sizes}, outside the "
            f"tensor's shape {shape} (dimension {outside[0]}); {_disagree(where)}"
        )
    if chunk["key"] != chunk_key(name, tuple(offsets)):
        raise ShardError(
            f"{where}: the chunk of {name} at offsets {offsets} has the key {key!r}, where "
            f"{chunk_key(name, tuple(offsets))!r} is written; {_disagree(where)}"
        )


def check_files(directory: Path, index: dict[str, Any], only: Iterable[str] | None = None) -> None:
    """Every chunk of a checked ``index`` (``only``: of those files) against the safetensors header of
    its file, before any tensor is read: the file holds the chunk's key with the index's dtype, the
    chunk's sizes as its shape and a byte range that holds them inside the file. A file whose header
    does not agree is first checked against its manifest hash, so that a damaged file is named as
    damaged."""
    where = directory / INDEX
    by_file: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for name, entry in index["tensors"].items():
        for chunk in entry["chunks"]:
            by_file.setdefault(chunk["file"], []).append((name, chunk))
    for file in sorted(set(by_file) if only is None else set(only) & set(by_file)):
        chunks = by_file[file]
        try:
            try:
                f = ShardFile(directory / file)
            except ShardError as err:
                name, chunk = chunks[0]
                raise ShardError(
                    f"{where} names {file!r} as the file of the chunk {chunk['key'][:200]!r} of {name}, "
                    f"but {err}"
                ) from None
            f.close()
            for name, chunk in chunks:
                _check_chunk(where, f, index["dtype"], name, chunk)
        except ShardError:
            verify(directory, [file])  # a file changed since it was written: say so instead
            raise


def _check_chunk(where: Path, f: ShardFile, dtype: str, name: str, chunk: dict[str, Any]) -> None:
    """One chunk of ``index.json`` (``where``) against the header of its file ``f``."""
    sizes, key, fix = chunk["sizes"], chunk["key"][:200], _disagree(where)
    info = f.header.get(chunk["key"])
    if info is None:
        raise ShardError(f"{f.path} holds no tensor {key!r}, which {where} names for {name}; {fix}")
    if info["dtype"] != dtype:
        raise ShardError(
            f"{f.path}: tensor {key!r} is {info['dtype']}, {where} gives {dtype} for every chunk; {fix}"
        )
    if info["shape"] != sizes:
        raise ShardError(
            f"{f.path}: tensor {key!r} has the shape {info['shape']}, {where} gives the sizes {sizes}; {fix}"
        )
    first, end = info["data_offsets"]
    width = torch.tensor([], dtype=_TORCH[dtype]).element_size()
    if end - first != math.prod(sizes) * width or f.base + end > f.size:
        raise ShardError(
            f"{f.path}: tensor {key!r} spans the bytes {first}-{end} of the data, which do not hold "
            f"{math.prod(sizes):,} {dtype} elements inside the file's {f.size - f.base:,} bytes of data; "
            f"{fix}"
        )


def _disagree(where: Path) -> str:
    """The fix of an index that does not match its checkpoint's files."""
    return (
        f"{where} and the files it names disagree (the checkpoint was altered, or assembled from "
        "different saves); use another checkpoint (tpe-ckpt list) or an unaltered copy of this one"
    )


def read_tensor(directory: Path, index: dict[str, Any], name: str) -> Tensor:
    """One whole global tensor (fp32), assembled from its chunks: what an offline export reads, one
    tensor at a time."""
    shape = tuple(index["tensors"][name]["shape"])
    out = torch.empty(shape, dtype=torch.float32)
    Plan(directory, index, [(Region.whole(name, shape), out.view(-1))]).run()
    return out
