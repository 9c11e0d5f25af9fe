"""Checkpoints, exports and token stores from elsewhere: every name read from their own files is data.

A real tiny run (checkpoints, its export, its token store) is made once; each test copies it and
crafts one thing a stranger's copy could hold: an absolute or ``..`` chunk name, ``/dev/zero``, a
symlink or a fifo where a file is listed, a ``latest`` naming another folder, huge or mistyped JSON.
Each must give one clear error through the real entry points (``tpe-ckpt``, ``tpe-eval``, a resume),
and an audit hook on ``open`` shows that nothing outside the folder was opened."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.models import TINY_RUN
from tpe_train.ckpt.cli import main as tpe_ckpt
from tpe_train.ckpt.store import entries, resume_choice
from tpe_train.data.cli import main as tpe_data
from tpe_train.data.store_open import load_store
from tpe_train.evaluation.cli import eval_main
from tpe_train.run import members
from tpe_train.run.lock import RunDirBusy, RunLock
from tpe_train.run.readers import alone, reading
from tpe_train.train.cli import main as tpe_train

pytestmark = pytest.mark.integration  # the run is made by the real tpe-train

TINY = TINY_RUN
STEP = "checkpoints/step-00000002"

# -- the audit hook: installed once per process (a hook cannot be removed), recording while asked --
Opened = list[tuple[str, int]]
_RECORD: Opened | None = None


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _RECORD is not None and isinstance(args[0], (str, bytes, os.PathLike)):
        _RECORD.append((os.fsdecode(args[0]), args[2] if isinstance(args[2], int) else 0))


@pytest.fixture(scope="session")
def audit_hook() -> None:
    if not getattr(sys, "_tpe_open_hook", False):
        sys.addaudithook(_hook)
        sys._tpe_open_hook = True  # type: ignore[attr-defined]


@pytest.fixture
def opened(audit_hook: None) -> Iterator[Opened]:
    """The paths opened while the test runs, with their flags."""
    global _RECORD
    _RECORD = []
    try:
        yield _RECORD
    finally:
        _RECORD = None


def _under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def assert_stayed_inside(record: Opened, base: Path, inside: list[Path]) -> None:
    """Under ``base`` (the test's folder) only ``inside`` was opened, nothing through a symlink that
    leads out of it, and no device."""
    for name, flags in record:
        path = Path(os.path.abspath(name))
        real = Path(os.path.realpath(name))
        if not flags & os.O_NOFOLLOW:  # an open that follows a link reaches the link's target
            path = real
        assert not _under(path, Path("/dev")) or path == Path("/dev/null"), f"{name} was opened"
        if _under(path, base) or _under(real, base):
            assert any(_under(path, root) for root in inside), f"{name} was opened ({path})"


# -- the real run, made once per session (``tiny_run`` of tests/conftest.py) -------------------------
@pytest.fixture(scope="module")
def made(tiny_run: Path) -> Path:
    return tiny_run


@pytest.fixture
def copy(made: Path, tmp_path: Path) -> Path:
    """A copy of the run (and its store) in this test's folder, and an ``outside`` folder beside it
    holding a valid copy of every file, the targets a crafted name would reach for."""
    shutil.copytree(made, tmp_path / "mine", symlinks=True)
    outside = tmp_path / "outside"
    shutil.copytree(made / "run" / STEP, outside)
    return tmp_path


def rewrite(ckpt: Path, name: str, data: bytes) -> None:
    """Replace a checkpoint's file and list it in the manifest as a forger would (size and hash)."""
    (ckpt / name).write_bytes(data)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def with_chunk_file(ckpt: Path, name: str) -> None:
    index = json.loads((ckpt / "index.json").read_text())
    next(iter(index["tensors"].values()))["chunks"][0]["file"] = name
    rewrite(ckpt, "index.json", json.dumps(index).encode())


def ckpt_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """``tpe-ckpt`` in this process: it must refuse (status 2) with one message; returns the message."""
    assert tpe_ckpt(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tpe-ckpt: ") and "Traceback" not in err, err
    return err


def eval_cli(capsys: pytest.CaptureFixture[str], export: Path) -> str:
    assert eval_main(["--checkpoint", str(export)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tpe-eval: ") and "Traceback" not in err, err
    return err


# -- chunk names in index.json --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("{outside}/model-00000.safetensors", "is absolute"),
        ("../../../outside/model-00000.safetensors", "points outside its folder"),
        ("/dev/zero", "is absolute"),
        ("sub/model-00000.safetensors", "holds a path separator"),
        ("optimizer-00000.safetensorz", "is not listed in the folder's manifest"),
    ],
)
def test_a_chunk_name_that_is_not_a_listed_plain_name_is_refused_by_export_and_average(
    copy: Path, capsys: pytest.CaptureFixture[str], opened: Opened, name: str, said: str
) -> None:
    run = copy / "mine" / "run"
    with_chunk_file(run / STEP, name.format(outside=copy / "outside"))
    out = copy / "mine" / "out"
    opened.clear()  # from here on: what the command opens
    err = ckpt_cli(capsys, "export", str(run / STEP), "--out", str(out))
    assert "index.json names the file" in err and said in err
    err = ckpt_cli(capsys, "average", str(run), "--last", "2", "--out", str(out))
    assert said in err
    assert not out.exists()
    assert_stayed_inside(opened, copy, [copy / "mine"])


def test_a_resume_from_a_crafted_checkpoint_stops_before_reading_outside(
    copy: Path, capsys: pytest.CaptureFixture[str], opened: Opened
) -> None:
    run = copy / "mine" / "run"
    with_chunk_file(run / STEP, "../../../outside/model-00000.safetensors")
    new = copy / "mine" / "new"
    argv = [*TINY, "train.max_steps=3", f"train.run_dir={new}", f"train.resume={run / STEP}"]
    opened.clear()  # from here on: what the command opens
    assert tpe_train([*argv, f"data.store_dir={copy / 'mine' / 'store'}"]) == 2
    err = capsys.readouterr().err
    assert "points outside its folder" in err and "Traceback" not in err
    assert not (new / "checkpoints").exists() or not entries(new / "checkpoints")
    assert_stayed_inside(opened, copy, [copy / "mine"])


def test_a_safetensors_header_declaring_a_gigabyte_is_refused_without_reading_it(
    copy: Path, capsys: pytest.CaptureFixture[str], opened: Opened
) -> None:
    ckpt = copy / "mine" / "run" / STEP
    data = bytearray((ckpt / "model-00000.safetensors").read_bytes())
    data[:8] = (1 << 30).to_bytes(8, "little")
    rewrite(ckpt, "model-00000.safetensors", bytes(data))
    opened.clear()  # from here on: what the command opens
    err = ckpt_cli(capsys, "export", str(ckpt), "--out", str(copy / "mine" / "out"))
    assert "declares a header of 1,073,741,824 bytes" in err
    assert_stayed_inside(opened, copy, [copy / "mine"])


# -- files that are not plain files of the checkpoint ---------------------------------------------
def test_a_listed_file_that_is_a_symlink_or_a_fifo_makes_the_checkpoint_incomplete(
    copy: Path, capsys: pytest.CaptureFixture[str], opened: Opened
) -> None:
    ckpt = copy / "mine" / "run" / STEP
    (ckpt / "model-00000.safetensors").unlink()  # the outside copy is byte-identical: hashes would match
    (ckpt / "model-00000.safetensors").symlink_to(copy / "outside" / "model-00000.safetensors")
    opened.clear()  # from here on: what the command opens
    err = ckpt_cli(capsys, "export", str(ckpt), "--out", str(copy / "mine" / "out"))
    assert "incomplete (model-00000.safetensors a symlink)" in err
    assert_stayed_inside(opened, copy, [copy / "mine"])
    (ckpt / "model-00000.safetensors").unlink()
    shutil.copy(copy / "outside" / "model-00000.safetensors", ckpt)
    (ckpt / "trainer.json").unlink()
    os.mkfifo(ckpt / "trainer.json")  # opened for reading without O_NONBLOCK, it would wait forever
    opened.clear()
    err = ckpt_cli(capsys, "export", str(ckpt), "--out", str(copy / "mine" / "out"))
    assert "incomplete (trainer.json missing, truncated or not a plain file)" in err
    assert_stayed_inside(opened, copy, [copy / "mine"])


def test_a_symlinked_file_is_refused_when_read_even_where_the_listing_passes(
    copy: Path, capsys: pytest.CaptureFixture[str], opened: Opened
) -> None:
    export = copy / "mine" / "run" / "checkpoint"
    (export / "tokenizer.json").unlink()
    (export / "tokenizer.json").symlink_to(copy / "mine" / "run" / "tokenizer.json")
    opened.clear()  # from here on: what the command opens
    err = eval_cli(capsys, export)
    assert "tokenizer.json cannot be read as a file of" in err and "(a symlink)" in err
    assert_stayed_inside(opened, copy, [export, copy / "mine" / "run" / "checkpoints"])


# -- latest --------------------------------------------------------------------------------------
@pytest.mark.parametrize("named", ["..", "../../other/checkpoints/step-00000002", "/etc", "step-2"])
def test_latest_must_name_a_checkpoint_beside_it(
    copy: Path, capsys: pytest.CaptureFixture[str], opened: Opened, named: str
) -> None:
    run = copy / "mine" / "run"
    (run / "checkpoints" / "latest").write_text(named + "\n")
    opened.clear()  # from here on: what the command opens
    err = ckpt_cli(capsys, "export", str(run), "--out", str(copy / "mine" / "out"))
    assert f"latest names {named!r}, not a checkpoint folder beside it" in err
    assert "tpe-ckpt list" in err  # the fix
    assert ckpt_cli(capsys, "list", str(run)) == err
    store = f"data.store_dir={copy / 'mine' / 'store'}"
    resumed = tpe_train([*TINY, "train.max_steps=3", f"train.run_dir={run}", "train.resume=auto", store])
    assert resumed == 2 and "not a checkpoint folder beside it" in capsys.readouterr().err
    assert_stayed_inside(opened, copy, [copy / "mine"])


def test_latest_as_a_symlink_is_refused(
    copy: Path, capsys: pytest.CaptureFixture[str], opened: Opened
) -> None:
    run = copy / "mine" / "run"
    (copy / "outside" / "latest").write_text("step-00000002\n")
    (run / "checkpoints" / "latest").unlink()
    (run / "checkpoints" / "latest").symlink_to(copy / "outside" / "latest")
    opened.clear()  # from here on: what the command opens
    err = ckpt_cli(capsys, "export", str(run), "--out", str(copy / "mine" / "out"))
    assert "latest cannot be read" in err and "(a symlink)" in err
    assert_stayed_inside(opened, copy, [copy / "mine"])


# -- huge and mistyped JSON ------------------------------------------------------------------------
def test_a_huge_manifest_is_not_read(copy: Path, capsys: pytest.CaptureFixture[str], opened: Opened) -> None:
    ckpt = copy / "mine" / "run" / STEP
    with open(ckpt / "manifest.json", "r+b") as f:  # sparse: 300 MiB declared, nothing written
        f.truncate(300 * members.MIB)
    opened.clear()  # from here on: what the command opens
    err = ckpt_cli(capsys, "export", str(ckpt), "--out", str(copy / "mine" / "out"))
    assert "unreadable manifest" in err and "is 300 MiB, more than the 256 MiB" in err
    assert_stayed_inside(opened, copy, [copy / "mine"])


@pytest.mark.parametrize(
    ("name", "change", "said"),
    [
        ("manifest.json", lambda m: {**m, "files": list(m["files"])}, "'files' is [\"config.yaml\""),
        ("manifest.json", lambda m: {**m, "step": "2"}, "'step' is \"2\", where an int is expected"),
        ("manifest.json", lambda m: [m], "holds a JSON list, where an object is expected"),
        ("trainer.json", lambda t: {**t, "step": True}, "'step' is true, where an int is expected"),
        ("index.json", lambda i: {**i, "tensors": []}, "'tensors' is [], where a dict is expected"),
    ],
)
def test_mistyped_json_gives_one_clear_error(
    copy: Path,
    capsys: pytest.CaptureFixture[str],
    opened: Opened,
    name: str,
    change: Any,
    said: str,
) -> None:
    ckpt = copy / "mine" / "run" / STEP
    data = json.dumps(change(json.loads((ckpt / name).read_text()))).encode()
    if name == "manifest.json":
        (ckpt / name).write_bytes(data)
    else:
        rewrite(ckpt, name, data)
    opened.clear()  # from here on: what the command opens
    err = ckpt_cli(capsys, "export", str(ckpt), "--out", str(copy / "mine" / "out"))
    assert said in err
    assert_stayed_inside(opened, copy, [copy / "mine"])


# -- exports -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda m: m["sha256"].update({"../../outside/model-00000.safetensors": "0" * 64}), "points outside"),
        (lambda m: m["sha256"].update({"/dev/zero": "0" * 64}), "is absolute"),
        (lambda m: m.update(sha256=["model.safetensors"]), "'sha256' is [\"model.safetensors\"]"),
        (lambda m: m.update(step="2"), "'step' is \"2\", where an int is expected"),
        (lambda m: m.update(pad="x" * 2 * members.MIB), "is 2 MiB, more than the 1 MiB"),
    ],
)
def test_a_crafted_export_meta_is_refused_by_tpe_eval_and_tpe_ckpt(
    copy: Path, capsys: pytest.CaptureFixture[str], opened: Opened, change: Any, said: str
) -> None:
    export = copy / "mine" / "run" / "checkpoint"
    meta = json.loads((export / "meta.json").read_text())
    change(meta)
    (export / "meta.json").write_text(json.dumps(meta))
    opened.clear()  # from here on: what the command opens
    err = eval_cli(capsys, export)
    assert said in err and "meta.json" in err
    err = ckpt_cli(capsys, "export", str(export), "--out", str(copy / "mine" / "hf"), "--format", "hf")
    assert said in err
    assert not (copy / "mine" / "hf").exists()
    assert_stayed_inside(opened, copy, [export, copy / "mine" / "run" / "checkpoints"])


def test_a_fifo_in_an_export_is_refused_without_waiting(
    copy: Path, capsys: pytest.CaptureFixture[str], opened: Opened
) -> None:
    export = copy / "mine" / "run" / "checkpoint"
    (export / "config.yaml").unlink()
    os.mkfifo(export / "config.yaml")
    opened.clear()  # from here on: what the command opens
    err = eval_cli(capsys, export)
    assert "config.yaml is not a regular file (a fifo)" in err
    assert_stayed_inside(opened, copy, [export, copy / "mine" / "run" / "checkpoints"])


# -- token stores --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("filename", "said"),
    [("../../../outside/model-00000.safetensors", "points outside"), ("/dev/zero", "is absolute")],
)
def test_a_token_store_naming_files_outside_is_refused(
    copy: Path, capsys: pytest.CaptureFixture[str], opened: Opened, filename: str, said: str
) -> None:
    (store,) = [p.parent for p in (copy / "mine" / "store").glob("*/meta.json")]
    state = json.loads((store / "train" / "state.json").read_text())
    state["_data_files"] = [{"filename": filename}]
    (store / "train" / "state.json").write_text(json.dumps(state))
    opened.clear()  # from here on: what the command opens
    with pytest.raises(members.MemberError, match=said):
        load_store(store)
    assert tpe_data(["prepare", *TINY, f"data.store_dir={store.parent}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tpe-data: ") and said in err and "state.json names the file" in err
    assert_stayed_inside(opened, copy, [store])


# -- the run lock and the readers' lock ----------------------------------------------------------
def test_run_lock_never_follows_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "precious.txt"
    target.write_text("mine\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.lock").symlink_to(target)
    with pytest.raises(RunDirBusy, match=r"run\.lock is a symlink"):
        RunLock(run).acquire()
    assert target.read_text() == "mine\n"


def test_pruning_waits_while_a_reader_holds_the_checkpoints(made: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(made / "run", run)
    cmd = [sys.executable, "-m", "tpe_train.train", *TINY, f"train.run_dir={run}", "train.save_every=1"]
    cmd += [f"data.store_dir={made / 'store'}", "train.keep_last=1"]
    with reading(run / "checkpoints"):  # as tpe-ckpt export holds it while it reads
        proc = subprocess.run([*cmd, "train.max_steps=4"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [e.step for e in entries(run / "checkpoints") if e.complete] == [1, 2, 3, 4]  # nothing pruned
    proc = subprocess.run([*cmd, "train.max_steps=5"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    kept = [e.step for e in entries(run / "checkpoints") if e.complete]
    assert 5 in kept and len(kept) <= 2  # caught up (the best validation's checkpoint may stay)


def test_an_export_and_tpe_eval_wait_for_a_prune_in_progress(made: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(made / "run", run)
    done: list[int] = []
    export = ["export", str(run), "--out", str(tmp_path / "out")]
    scoring = ["--checkpoint", str(run / "checkpoint"), "--limit", "2"]
    with alone(run / "checkpoints") as held:  # as a prune holds it
        assert held
        workers = [
            threading.Thread(target=lambda: done.append(tpe_ckpt(export))),
            threading.Thread(target=lambda: done.append(eval_main(scoring))),
        ]
        for worker in workers:
            worker.start()
        time.sleep(1.0)
        assert not done and not (tmp_path / "out").exists()  # waiting, not failing
    for worker in workers:
        worker.join(120)
    assert done == [0, 0] and (tmp_path / "out" / "model.safetensors").is_file()


def test_a_corrupt_checkpoint_stays_in_place_while_a_reader_holds_the_checkpoints(
    made: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(made / "run", run)
    shard = run / STEP / "model-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with reading(run / "checkpoints"):
        assert resume_choice("auto", run) == run / "checkpoints" / "step-00000001"
    assert (run / STEP).is_dir()  # not moved from under the reader
    assert resume_choice("auto", run) == run / "checkpoints" / "step-00000001"
    assert not (run / STEP).exists() and (run / f"{STEP}.corrupt").is_dir()
