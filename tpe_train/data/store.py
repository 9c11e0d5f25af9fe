"""Store: the pipeline's last stage. The binarised token store: tokenised train/valid sets and the
tokenizer, memory-mapped Arrow on disk, at a path keyed by a fingerprint of everything that shapes them
(corpus, cleaning, tokenizer settings, length limit; data/specs.py). ``tpe-data prepare`` builds it
ahead of training so that the ranks of a multi-node job only read it (data/store_open.py); a run whose
fingerprint matches reuses it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from datasets import Dataset
from tokenizers import Tokenizer

from tpe_train.data.tokenizer import vocab_hash
from tpe_train.run.atomic import fsync_dir, temp_name
from tpe_train.run.outputs import mark_output

STORE_VERSION = 2  # bump when the stored columns change (2: uint16/int32 ids, no training text)


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(Path(folder) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(folder))


def write_store(path: Path, tok: Tokenizer, train: Dataset, valid: Dataset, meta: dict[str, Any]) -> None:
    """Write under a temporary name unique across hosts, fsync, then rename: a crash never leaves a
    half store at ``path``, and two nodes never touch each other's temporaries."""
    tmp = temp_name(path)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    try:
        tok.save(str(tmp / "tokenizer.json"))
        for name, ds in (("train", train), ("valid", valid)):
            # An empty set (a streamed corpus's train) needs one shard written, or it cannot be loaded back.
            ds.save_to_disk(str(tmp / name), num_shards=1 if len(ds) == 0 else None)
        (tmp / "meta.json").write_text(json.dumps({**meta, "vocab_hash": vocab_hash(tok)}, indent=2))
        mark_output(tmp, "tpe-data prepare", "token-store")
        _fsync_tree(tmp)
    except BaseException:  # nothing half-written stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        tmp.rename(path)
    except OSError:  # another process finished the same store first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
        if not (path / "meta.json").is_file():
            raise
    fsync_dir(path.parent)
