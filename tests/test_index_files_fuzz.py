"""A checkpoint's ``index.json`` against its own safetensors files, before any tensor is read.

A forger (or a checkpoint put together from two saves) can hand over an index that its manifest lists
with the right size and SHA-256 but whose chunks are not what the files hold: another file, another
key, another dtype, shape or byte range. Hypothesis generates such checkpoints from a real tiny one
(the index changed, or a safetensors header rewritten, and the manifest's entry recomputed each
time) and runs each through the commands that read a checkpoint's tensors: ``tpe-ckpt export`` (native
and HF), ``tpe-ckpt average`` and ``tpe-ckpt reshard``, in this process through their ``main``, and a
few through real processes (``tpe-ckpt export``, ``tpe-ckpt reshard``, a resume of ``tpe-train``).
Each must stop with one clear error (exit status 2, one line naming the file, no traceback) and write
nothing. ``tpe-eval`` and ``tpe-translate`` read exports, never an index: they refuse a training
checkpoint, naming ``tpe-ckpt export`` (tests/test_step_folders.py). Derandomized: the same
``EXAMPLES`` each run (docs/reliability.md counts them)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.support.fuzz import fuzz
from tests.support.models import TINY_RUN
from tpe_train.ckpt.cli import main as tpe_ckpt

ROOT = Path(__file__).parents[1]
STEP = "step-00000001"
LAUNCH = str(ROOT / "configs" / "accelerate" / "cpu_single.yaml")
SHARDS = ("model-00000.safetensors", "optimizer-00000.safetensors")
#: the commands that read a checkpoint's tensors, as ``tpe-ckpt`` arguments ({ckpt}, {run}, {out})
COMMANDS = {
    "export": ["export", "{ckpt}", "--out", "{out}"],
    "export-hf": ["export", "{ckpt}", "--out", "{out}", "--format", "hf"],
    "average": ["average", "{run}", "--last", "1", "--out", "{out}"],
    "reshard": ["reshard", "{ckpt}", "--config_file", LAUNCH, "--out", "{out}"],
}
INDEX_EXAMPLES = 60  # per command: an index.json that does not match the files
HEADER_EXAMPLES = 30  # per command: a safetensors header that does not match the index
PROCESSES = ["export", "reshard", "resume"]  # the commands started as processes, each on every case
EXAMPLES = (INDEX_EXAMPLES + HEADER_EXAMPLES) * len(COMMANDS)


def fuzzing(examples: int) -> settings:
    """``fuzz(examples)``, with capsys (cleared by each example) beside hypothesis."""
    return settings(fuzz(examples), suppress_health_check=[HealthCheck.function_scoped_fixture])


def scratch(made: Path, tmp: Path) -> Path:
    """A copy of the made checkpoint as ``tmp/run/checkpoints/step-…`` (a run directory's layout)."""
    ckpt = tmp / "run" / "checkpoints" / STEP
    shutil.copytree(made / "run" / "checkpoints" / STEP, ckpt)
    return ckpt


def forge(ckpt: Path, name: str, data: bytes) -> None:
    """Replace ``ckpt/name`` and list it in the manifest with its new size and SHA-256."""
    (ckpt / name).write_bytes(data)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def read_shard(path: Path) -> tuple[dict[str, Any], bytes]:
    """A safetensors file's header (metadata aside) and its data."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    header.pop("__metadata__", None)
    return header, raw[8 + length :]


def shard_bytes(header: dict[str, Any], data: bytes) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


# -- what is changed --------------------------------------------------------------------------------
INDEX_CHANGES = (
    "dtype",
    "file",
    "key",
    "swap",
    "split",
    "offsets",
    "sizes",
    "shape",
    "drop",
    "twice",
    "rename",
)


@st.composite
def changed_index(draw: st.DrawFn, index: dict[str, Any], files: list[str]) -> tuple[str, dict[str, Any]]:
    """``index`` with one thing changed that the files do not hold (every change keeps its JSON types)."""
    index = copy.deepcopy(index)
    tensors = index["tensors"]
    how = draw(st.sampled_from(INDEX_CHANGES))
    name = draw(st.sampled_from(sorted(tensors)))
    entry = tensors[name]
    chunk, shape = entry["chunks"][0], entry["shape"]
    dim = draw(st.integers(0, len(shape) - 1))
    if how == "dtype":  # a dtype the files do not have
        index["dtype"] = draw(st.sampled_from(["F16", "BF16", "F64"]))
    elif how == "file":  # another file of the checkpoint: the other shard file, or a JSON or YAML one
        chunk["file"] = draw(st.sampled_from([f for f in files if f != chunk["file"]]))
    elif how == "key":  # another tensor's key
        keys = sorted(c["key"] for e in tensors.values() for c in e["chunks"] if c is not chunk)
        chunk["key"] = draw(st.sampled_from(keys))
    elif how == "swap":  # the chunks of two tensors of one shape exchanged: the data of each other
        other = draw(
            st.sampled_from(sorted(n for n, e in tensors.items() if e["shape"] == shape and n != name))
        )
        entry["chunks"], tensors[other]["chunks"] = tensors[other]["chunks"], entry["chunks"]
    elif how == "split" and shape[0] > 1:  # two chunks of rows, where the file holds one
        row = draw(st.integers(1, shape[0] - 1))
        rest = [0] * (len(shape) - 1)
        second = {**chunk, "key": f"{name}@{','.join(map(str, [row, *rest]))}", "offsets": [row, *rest]}
        chunk["sizes"] = [row, *shape[1:]]
        second["sizes"] = [shape[0] - row, *shape[1:]]
        entry["chunks"].append(second)
    elif how == "offsets":  # the chunk moved along one dimension
        chunk["offsets"][dim] += draw(st.integers(1, 3))
    elif how == "sizes":  # the chunk's sizes and the tensor's shape changed alike
        new = max(1, shape[dim] + draw(st.sampled_from([-3, -1, 1, 2, 7])))
        shape[dim] = chunk["sizes"][dim] = new if new != shape[dim] else new + 1
    elif how == "shape":  # the same number of elements in another shape
        new = list(reversed(shape)) if len(shape) > 1 and shape[0] != shape[-1] else [*shape, 1]
        entry["shape"], chunk["sizes"] = new, list(new)
        chunk["offsets"] = [0] * len(new)
        chunk["key"] = f"{name}@{','.join(['0'] * len(new))}"
    elif how == "drop":
        entry["chunks"] = []
    elif how == "twice":
        entry["chunks"].append(dict(chunk))
    else:  # "rename", and "split" of a tensor of one row: the tensor under another name
        tensors[name + draw(st.sampled_from([".x", "_", "0"]))] = tensors.pop(name)
        how = "rename"
    return how, index


HEADER_CHANGES = ("dtype", "shape", "key", "offsets", "removed")


@st.composite
def changed_header(draw: st.DrawFn, ckpt: Path) -> tuple[str, str, bytes]:
    """A shard file of ``ckpt`` with one tensor's header entry changed (or the tensor removed)."""
    file = draw(st.sampled_from(SHARDS))
    header, data = read_shard(ckpt / file)
    how = draw(st.sampled_from(HEADER_CHANGES))
    key = draw(st.sampled_from(sorted(header)))
    info = header[key]
    if how == "dtype":  # the same bytes declared as another dtype
        info["dtype"] = draw(st.sampled_from(["F16", "BF16", "F64"]))
    elif how == "shape":  # the same elements in another shape
        shape = info["shape"]
        info["shape"] = list(reversed(shape)) if len(shape) > 1 and shape[0] != shape[-1] else [*shape, 1]
    elif how == "key":
        header[key + draw(st.sampled_from(["x", ".0", " "]))] = header.pop(key)
    elif how == "offsets":  # a byte range moved by a few elements
        shift = 4 * draw(st.sampled_from([-2, -1, 1, 3]))
        first, end = info["data_offsets"]
        info["data_offsets"] = [max(0, first + shift), max(0, end + shift)]
    else:  # the tensor and its bytes removed: a well-formed file that lacks it
        first, end = header.pop(key)["data_offsets"]
        data = data[:first] + data[end:]
        for other in header.values():
            if other["data_offsets"][0] >= end:
                other["data_offsets"] = [o - (end - first) for o in other["data_offsets"]]
    return how, file, shard_bytes(header, data)


# -- the commands -----------------------------------------------------------------------------------
def argv_of(command: str, ckpt: Path, out: Path) -> list[str]:
    run = ckpt.parents[1]
    return [a.format(ckpt=ckpt, run=run, out=out) for a in COMMANDS[command]]


def assert_refused(code: int, err: str, ckpt: Path, out: Path, prog: str = "tpe-ckpt") -> None:
    """One clear error: status 2, one line naming a file of the checkpoint and the fix, no traceback, nothing
    written."""
    assert code == 2, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: {ckpt}"), err[-3000:]
    assert "index.json" in err or ".safetensors" in err, err
    assert "use another checkpoint (tpe-ckpt list)" in err or "use another copy" in err, err  # the fix
    assert not out.exists() and sorted(os.listdir(out.parent)) == ["run"]


def in_process(capsys: pytest.CaptureFixture[str], command: str, ckpt: Path) -> None:
    out = ckpt.parents[2] / "out"
    capsys.readouterr()
    code = tpe_ckpt(argv_of(command, ckpt, out))
    assert_refused(code, capsys.readouterr().err, ckpt, out)


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
@fuzzing(INDEX_EXAMPLES)
@given(data=st.data())
def test_an_index_that_does_not_match_its_files_is_one_error_before_any_read(
    tiny_step: Path, capsys: pytest.CaptureFixture[str], command: str, data: st.DataObject
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = scratch(tiny_step, Path(tmp))
        files = sorted(json.loads((ckpt / "manifest.json").read_text())["files"])
        index = json.loads((ckpt / "index.json").read_text())
        how, changed = data.draw(changed_index(index, [f for f in files if f != "index.json"]), label="index")
        event(how)
        forge(ckpt, "index.json", json.dumps(changed).encode())
        in_process(capsys, command, ckpt)


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
@fuzzing(HEADER_EXAMPLES)
@given(data=st.data())
def test_a_safetensors_header_that_does_not_match_the_index_is_one_error_before_any_read(
    tiny_step: Path, capsys: pytest.CaptureFixture[str], command: str, data: st.DataObject
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = scratch(tiny_step, Path(tmp))
        how, file, new = data.draw(changed_header(ckpt), label="header")
        event(how)
        forge(ckpt, file, new)
        in_process(capsys, command, ckpt)


# -- a few through real processes -------------------------------------------------------------------
def _swapped(ckpt: Path) -> None:
    """Two tensors of one shape exchange their chunks (read without the check: each other's weights)."""
    index = json.loads((ckpt / "index.json").read_text())
    tensors = index["tensors"]
    a, b = sorted(n for n, e in tensors.items() if e["shape"] == [16, 16])[:2]
    tensors[a]["chunks"], tensors[b]["chunks"] = tensors[b]["chunks"], tensors[a]["chunks"]
    forge(ckpt, "index.json", json.dumps(index).encode())


def _split(ckpt: Path) -> None:
    """The embedding's one chunk listed as two chunks of rows."""
    index = json.loads((ckpt / "index.json").read_text())
    name, entry = next((n, e) for n, e in index["tensors"].items() if e["shape"][0] == 400)
    chunk = entry["chunks"][0]
    chunk["sizes"] = [100, 16]
    entry["chunks"].append({**chunk, "key": f"{name}@100,0", "offsets": [100, 0], "sizes": [300, 16]})
    forge(ckpt, "index.json", json.dumps(index).encode())


def _transposed(ckpt: Path) -> None:
    """A [32, 16] tensor's header declares [16, 32]: the same bytes in another shape."""
    header, data = read_shard(ckpt / SHARDS[0])
    key = next(k for k, info in sorted(header.items()) if info["shape"] == [32, 16])
    header[key]["shape"] = [16, 32]
    forge(ckpt, SHARDS[0], shard_bytes(header, data))


CASES = {"swapped": _swapped, "split": _split, "transposed": _transposed}


@pytest.mark.integration
@pytest.mark.parametrize("command", PROCESSES)
@pytest.mark.parametrize("case", CASES)
def test_a_mismatched_checkpoint_through_a_real_process(
    tiny_step: Path, tmp_path: Path, command: str, case: str
) -> None:
    ckpt = scratch(tiny_step, tmp_path)
    CASES[case](ckpt)
    out = tmp_path / "out"
    if command == "resume":
        cmd = [sys.executable, "-m", "tpe_train.train", *TINY_RUN, "train.max_steps=2"]
        cmd += [f"train.run_dir={out}", f"train.resume={ckpt}", f"data.store_dir={tiny_step / 'store'}"]
        prog = "tpe-train"
    else:
        cmd = [sys.executable, "-m", "tpe_train.ckpt.cli", *argv_of(command, ckpt, out)]
        prog = "tpe-ckpt"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ})
    err = proc.stderr
    if command == "resume":  # the run directory is made, and the config written, before the resume
        assert proc.returncode == 2 and "Traceback" not in err, err[-3000:]
        assert f"{ckpt}" in err and not (out / "checkpoints").exists()
        return
    assert_refused(proc.returncode, err, ckpt, out, prog)


def test_the_example_counts_are_what_the_docs_say() -> None:
    """docs/reliability.md states how many examples these tests generate, per command."""
    docs = (ROOT / "docs" / "reliability.md").read_text()
    assert f"{EXAMPLES} generated examples" in docs
    for command in (
        "`tpe-ckpt export`",
        "`tpe-ckpt export --format hf`",
        "`tpe-ckpt average`",
        "`tpe-ckpt reshard`",
    ):
        assert f"| {command} | {INDEX_EXAMPLES} | {HEADER_EXAMPLES} |" in docs
    assert f"({len(CASES) * len(PROCESSES)} processes)" in docs
