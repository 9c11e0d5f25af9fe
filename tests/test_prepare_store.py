"""Preparation in bounded memory and under a lock: de-duplication by 8-byte hashes keeps what the
whole-list de-duplication kept, a validation set that could not be used stops before the long work,
and two processes preparing one store build it once."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from datasets import Dataset

from tpe_train.config import load_config
from tpe_train.data.clean import CleanSpec, clean
from tpe_train.data.dedup import first_of_each
from tpe_train.data.errors import CorpusError
from tpe_train.data.prepare import prepare


def _whole_list_dedup(src: list[str], tgt: list[str]) -> list[tuple[str, str]]:
    """The reference: keep the first of each pair, every pair held as a Python object."""
    seen: set[bytes] = set()
    kept = []
    for s, t in zip(src, tgt, strict=True):
        key = hashlib.blake2b(f"{s}\t{t}".encode(), digest_size=16).digest()
        if key not in seen:
            kept.append((s, t))
        seen.add(key)
    return kept


def test_hashed_dedup_keeps_what_the_whole_list_dedup_kept() -> None:
    import random

    rng = random.Random(0)
    words = ["a", "b", "c", "d"]
    pairs = [(" ".join(rng.choices(words, k=3)), " ".join(rng.choices(words, k=2))) for _ in range(3000)]
    pairs += [("a  b", "c"), ("a b ", "c"), ("a b", "c")]  # equal after whitespace clean-up
    src, tgt = [p[0] for p in pairs], [p[1] for p in pairs]
    normalized, _ = clean(Dataset.from_dict({"src": src, "tgt": tgt}), CleanSpec(normalize="NFKC"))
    kept, duplicates = first_of_each(normalized)
    want = _whole_list_dedup(normalized["src"], normalized["tgt"])
    assert list(zip(kept["src"], kept["tgt"], strict=True)) == want
    assert duplicates == len(pairs) - len(want) > 2000


def _corpus(root: Path, valid: tuple[str, str] = ("ein test\n", "a test\n"), n: int = 400) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.de").write_text("".join(f"das haus {i} ist klein\n" for i in range(n)))
    (root / "train.en").write_text("".join(f"the house {i} is small\n" for i in range(n)))
    (root / "validation.de").write_text(valid[0])
    (root / "validation.en").write_text(valid[1])
    (root / "test.de").write_text("ein haus\n")
    (root / "test.en").write_text("a house\n")
    return root


def _data_cfg(root: Path, store: Path, *extra: str):  # type: ignore[no-untyped-def]
    overrides = ["data.corpus=text", f"data.path={root}", f"data.store_dir={store}", "data.vocab_size=60"]
    return load_config("demo", [*overrides, *extra]).data


def test_an_empty_validation_set_stops_before_the_training_split_is_cleaned(tmp_path: Path) -> None:
    cfg = _data_cfg(_corpus(tmp_path / "c", valid=("\n\n", "\n\n")), tmp_path / "store")
    with pytest.raises(CorpusError, match=r"data.valid_split='validation' .* has no pairs"):
        prepare(cfg)
    assert not any((tmp_path / "store").glob("text-*"))


def test_a_validation_set_where_nothing_fits_max_len_stops_before_training(tmp_path: Path) -> None:
    long = " ".join(f"wort{i}" for i in range(40)) + "\n"
    cfg = _data_cfg(_corpus(tmp_path / "c", valid=(long, long)), tmp_path / "store", "data.max_len=8")
    with pytest.raises(CorpusError, match=r"no pair of the validation split .* fits data.max_len=8"):
        prepare(cfg)
    assert not any((tmp_path / "store").glob("text-*"))


_CHILD = """
import json, logging, os, sys, time
from tpe_train.config import load_config
from tpe_train.data.prepare import prepare
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
root, store, gate, me = sys.argv[1:5]
cfg = load_config("demo", ["data.corpus=text", f"data.path={root}", f"data.store_dir={store}",
                           "data.vocab_size=60"]).data
open(f"{gate}/{me}", "w").close()  # imported and configured: wait for the other, then go together
while len(os.listdir(gate)) < 2:
    time.sleep(0.01)
data = prepare(cfg)
print(json.dumps({"built": data.built, "store": str(data.store), "train": len(data.train)}))
"""


@pytest.mark.integration
def test_two_processes_preparing_one_store_build_it_once(tmp_path: Path) -> None:
    root, store, gate = _corpus(tmp_path / "c", n=3000), tmp_path / "store", tmp_path / "gate"
    gate.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(root), str(store), str(gate), str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert sorted(r["built"] for r in results) == [False, True]
    assert results[0]["store"] == results[1]["store"] and results[0]["train"] == results[1]["train"] == 3000
    assert sum("waiting for another process that prepares" in err for _, err in outs) == 1
    entries = sorted(p.name for p in store.iterdir())
    assert entries == sorted([Path(results[0]["store"]).name, f".{Path(results[0]['store']).name}.lock"])
