"""Opening a token store from outside the pipeline: a complete one, memory-mapped (``load_store``),
or the build lock (``store_lock``): one process builds a store at a time; the others wait and reuse it.
"""

from __future__ import annotations

import fcntl
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from datasets import Dataset
from tokenizers import Tokenizer

from tpe_train.data.errors import CorpusError
from tpe_train.data.saved import load_saved
from tpe_train.data.tokenizer import vocab_hash
from tpe_train.run import members

log = logging.getLogger(__name__)


def load_store(path: Path) -> tuple[Tokenizer, Dataset, Dataset, dict[str, Any]] | None:
    """(tokenizer, train, valid, metadata) of a complete store, or None when there is none. A damaged
    store is a ``MemberError`` naming the file and telling to delete the store: it is never deleted here,
    as other ranks or jobs may be reading it, and a read error may pass."""
    meta_path = path / "meta.json"
    if not meta_path.exists() and not meta_path.is_symlink():  # written last: marks a complete store
        if path.is_dir() and any(path.iterdir()):  # a store is renamed into place whole: not one
            raise CorpusError(
                f"{path} exists but is not a token store (no meta.json): it is not tpe-data's to replace; "
                "move or remove it yourself, or choose another data.store_dir"
            )
        return None
    fix = (
        f"the token store was damaged or made by something else: delete {path} and run tpe-data prepare "
        "(or the training run) again to build it anew"
    )
    try:
        meta = members.read_json(path, "meta.json", META_FIELDS, members.MIB)
        members.check_type(meta.get("report", []), list, f"{meta_path}: 'report'")
        tok = _tokenizer(path)
        if meta["vocab_hash"] != vocab_hash(tok):
            raise members.MemberError(f"{path / 'tokenizer.json'} does not match meta.json; {members.FIX}")
    except members.MemberError as err:
        raise members.MemberError(str(err).replace(members.FIX, fix)) from None
    train, valid = (load_saved(path / name, members.MemberError, fix) for name in ("train", "valid"))
    for name, ds in (("train", train), ("valid", valid)):
        _check_columns(path / name, ds, fix)
        _check_ids(path / name, ds, tok.get_vocab_size(), fix)
    return tok, train, valid, meta


META_FIELDS = {"vocab_hash": str, "dropped_too_long": int}
#: The columns of a stored split that training reads, with their Arrow types.
COLUMNS = {
    "id": (pa.int64(),),
    "src_ids": (pa.list_(pa.uint16()), pa.list_(pa.int32())),
    "tgt_ids": (pa.list_(pa.uint16()), pa.list_(pa.int32())),
    "src_len": (pa.int32(),),
    "tgt_len": (pa.int32(),),
}


def _tokenizer(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_str(members.read_text(path, "tokenizer.json"))
    except Exception as err:  # the tokenizers library raises its own exception type
        if isinstance(err, members.MemberError):
            raise
        raise members.MemberError(
            f"{path / 'tokenizer.json'} is not a tokenizer ({err}); {members.FIX}"
        ) from None


def _check_columns(folder: Path, ds: Dataset, fix: str) -> None:
    """Stop unless a stored split has the columns training reads, of the types the store writes (an empty
    split has none to read: a streamed corpus's store holds an empty training split of no columns)."""
    if len(ds) == 0:
        return
    schema = ds.data.schema
    for name, types in COLUMNS.items():
        index = schema.get_field_index(name)
        if index < 0 or schema.field(index).type not in types:
            found = "none" if index < 0 else str(schema.field(index).type)
            wanted = " or ".join(map(str, types))
            problem = f"holds no column {name} of type {wanted} (found: {found})"
            raise members.MemberError(f"{folder} {problem}; {fix}")


def _check_ids(folder: Path, ds: Dataset, vocab: int, fix: str) -> None:
    """Stop unless every token id of a stored split is one of its tokenizer's (an id past the embedding
    table stops a CPU run with an IndexError deep in the model and a GPU run with a device-side assert)
    and every ``src_len``/``tgt_len`` is its list's length (batching plans by them). Vectorised over the
    memory-mapped columns, ``CHECK_ROWS`` pairs at a time so that its temporaries stay a few MiB at any
    corpus size; a changed id within range is not seen."""
    columns = ["src_ids", "tgt_ids", "src_len", "tgt_len"]
    for batch in ds.data.table.select(columns).to_batches(max_chunksize=CHECK_ROWS) if len(ds) else []:
        for side in ("src", "tgt"):
            ids, stated = batch.column(f"{side}_ids"), batch.column(f"{side}_len")
            bounds = pc.min_max(ids.flatten())
            low, high = bounds["min"].as_py(), bounds["max"].as_py()
            if low is not None and (low < 0 or high >= vocab):
                problem = f"holds {side}_ids from {low} to {high}, outside its tokenizer's {vocab} ids"
                raise members.MemberError(f"{folder} {problem}; {fix}")
            lengths = pc.list_value_length(ids).cast(pa.int32())
            if ids.null_count or stated.null_count or not pc.all(pc.equal(lengths, stated)).as_py():
                problem = f"holds a {side}_len that is not its {side}_ids' length"
                raise members.MemberError(f"{folder} {problem}; {fix}")


#: Pairs per slice of the id check (about 8 MiB of temporaries).
CHECK_ROWS = 1 << 20


@contextmanager
def store_lock(path: Path) -> Iterator[None]:
    """Hold the build lock of the store at ``path`` (``.<name>.lock`` beside it): of two processes
    preparing one store (``tpe-study --jobs N``, a Slurm array), one builds while the other waits,
    then finds the store complete and reuses it. ``flock`` also holds across the nodes of a cluster
    file system that supports it (Lustre, GPFS, NFSv4 with locking); the lock file stays, empty."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process that prepares %s", path)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
