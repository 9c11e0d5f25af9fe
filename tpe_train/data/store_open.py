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

from datasets import Dataset, load_from_disk
from tokenizers import Tokenizer

from tpe_train.data.errors import CorpusError
from tpe_train.data.tokenizer import vocab_hash
from tpe_train.run import members

log = logging.getLogger(__name__)


def load_store(path: Path) -> tuple[Tokenizer, Dataset, Dataset, dict[str, Any]] | None:
    """(tokenizer, train, valid, metadata) of a complete store, or None when there is none."""
    meta_path = path / "meta.json"
    if not meta_path.exists() and not meta_path.is_symlink():  # written last: marks a complete store
        if path.is_dir() and any(path.iterdir()):  # a store is renamed into place whole: not one
            raise CorpusError(
                f"{path} exists but is not a token store (no meta.json): it is not tpe-data's to replace; "
                "move or remove it yourself, or choose another data.store_dir"
            )
        return None
    meta = members.read_json(path, "meta.json", {"vocab_hash": str}, members.MIB)
    try:
        tok = Tokenizer.from_str(members.read_text(path, "tokenizer.json"))
    except Exception as err:  # the tokenizers library raises its own exception type
        if isinstance(err, members.MemberError):
            raise
        raise members.MemberError(
            f"{path / 'tokenizer.json'} is not a tokenizer ({err}); {members.FIX}"
        ) from None
    if meta.get("vocab_hash") != vocab_hash(tok):
        raise ValueError(
            f"the token store {path} is inconsistent (its tokenizer.json does not match meta.json); "
            "delete the directory and prepare it again"
        )
    train, valid = (load_from_disk(str(_checked_split(path / name))) for name in ("train", "valid"))
    assert isinstance(train, Dataset) and isinstance(valid, Dataset)
    return tok, train, valid, meta


def _checked_split(folder: Path) -> Path:
    """A stored split whose ``state.json`` names only plain, regular files of the split's folder."""
    state = members.read_json(folder, "state.json", {"_data_files": list}, members.MIB)
    for entry in state["_data_files"]:
        members.check_type(entry, dict, f"{folder / 'state.json'}: a data file", members.MemberError)
        members.check_name(entry.get("filename"), folder / "state.json")
        members.check_file(folder, entry["filename"])
    members.check_file(folder, "dataset_info.json", members.MIB)
    return folder


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
