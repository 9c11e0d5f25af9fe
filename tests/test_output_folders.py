"""No command deletes what it did not write: every writer of an output folder refuses a folder holding a
user's file and a run directory (both left intact), replaces an earlier output of its own kind, and keeps
that earlier output when it fails midway; ``prune`` leaves what it cannot read."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tpe_train.ckpt import ct2, export, hf
from tpe_train.ckpt.cli import main as ckpt_main
from tpe_train.ckpt.store import prune
from tpe_train.config import load_config
from tpe_train.evaluation.cli import eval_main
from tpe_train.run.outputs import MARKER, marker

TINY = [
    "model.d_model=16", "model.n_heads=2", "model.ffn_dim=32", "model.encoder_layers=1",
    "model.decoder_layers=1", "model.dropout=0.0", "data.vocab_size=80", "data.synthetic.train_size=200",
    "data.synthetic.valid_size=10", "data.synthetic.test_size=6", "data.synthetic.probe_size=4",
    "data.synthetic.long_size=4", "data.synthetic.max_words=6", "data.synthetic.long_max_words=8",
    "data.max_tokens=256", "train.max_steps=4", "train.save_every=2", "train.keep_last=5",
    "train.log_every=1000", "train.valid_every=1000", "train.valid_bleu_size=0", "train.progress=false",
    "train.threads=1", "eval.at_end=false", "eval.max_tokens=120", "eval.max_len_b=4",
]  # fmt: skip
WRITERS = ("export", "average", "hf", "ctranslate2")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tpe_train.train.loop import run

    root = tmp_path_factory.mktemp("outputs")
    run(load_config("demo", [*TINY, f"train.run_dir={root / 'run'}"]))  # about 2 s: checkpoints at 2 and 4
    return root / "run"


def argv(writer: str, source: Path, out: Path, step: int = 4) -> list[str]:
    """The command line of ``writer`` from ``source`` (a run directory) at its checkpoint ``step``
    (``average``: the mean of the last ``step // 2`` checkpoints)."""
    checkpoint = str(source / "checkpoints" / f"step-{step:08d}")
    if writer == "average":
        return ["average", str(source), "--last", str(3 - step // 2), "--out", str(out)]
    formats = {"export": [], "hf": ["--format", "hf"], "ctranslate2": ["--format", "ctranslate2"]}
    return ["export", checkpoint, "--out", str(out), *formats[writer]]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".tpe-tmp-" in p.name]


@pytest.mark.parametrize("writer", WRITERS)
def test_a_folder_holding_a_users_file_is_refused_and_the_file_kept(
    writer: str, run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "mydocs"
    out.mkdir()
    (out / "thesis.txt").write_text("chapter one\n")
    assert ckpt_main(argv(writer, run_dir, out)) == 2
    err = capsys.readouterr().err
    assert f"--out {out} exists and holds files that tpe-ckpt" in err and "thesis.txt" in err
    assert "Choose another --out" in err
    assert snapshot(out) == {"thesis.txt": b"chapter one\n"} and leftovers(tmp_path) == []


@pytest.mark.parametrize("writer", WRITERS)
def test_a_run_directory_as_out_is_refused_and_left_intact(
    writer: str, run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = shutil.copytree(run_dir, tmp_path / "other-run")  # another user's run
    before, own = snapshot(other), snapshot(run_dir)
    assert ckpt_main(argv(writer, run_dir, other)) == 2
    assert f"--out {other} is a run directory of tpe-train" in capsys.readouterr().err
    assert ckpt_main(argv(writer, run_dir, run_dir)) == 2  # the run being read
    assert f"--out {run_dir} is or holds" in capsys.readouterr().err
    inside = run_dir / "checkpoints" / "mine"
    assert ckpt_main(argv(writer, run_dir, inside)) == 2
    assert "lies inside" in capsys.readouterr().err and not inside.exists()
    assert snapshot(other) == before and snapshot(run_dir) == own


@pytest.mark.parametrize("writer", WRITERS)
def test_a_second_output_replaces_the_first(writer: str, run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "exported"
    assert ckpt_main(argv(writer, run_dir, out, step=2)) == 0
    first = snapshot(out)
    assert marker(out) is not None and marker(out)["files"] == sorted(k for k in first if k != MARKER)
    assert ckpt_main(argv(writer, run_dir, out, step=4)) == 0
    fresh = tmp_path / "fresh" / "exported"
    assert ckpt_main(argv(writer, run_dir, fresh, step=4)) == 0
    assert snapshot(out) == snapshot(fresh) != first
    assert leftovers(tmp_path) == []


FAILURES: dict[str, tuple[object, str]] = {  # where each writer fails after some of its files are written
    "export": (export, "sha256"),
    "average": (export, "sha256"),
    "hf": (hf, "model_card"),
    "ctranslate2": (ct2, "readme"),
}


@pytest.mark.parametrize("writer", WRITERS)
def test_a_failure_midway_keeps_the_earlier_output(
    writer: str, run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "exported"
    assert ckpt_main(argv(writer, run_dir, out, step=2)) == 0
    before = snapshot(out)

    def broken(*args: object, **kw: object) -> str:
        raise OSError(28, "No space left on device")

    module, name = FAILURES[writer]
    monkeypatch.setattr(module, name, broken)
    with pytest.raises(OSError, match="No space left"):
        ckpt_main(argv(writer, run_dir, out, step=4))
    assert snapshot(out) == before and leftovers(tmp_path) == []


@pytest.mark.slow
def test_the_eval_job_averages_scores_and_a_requeue_replaces_both(run_dir: Path, tmp_path: Path) -> None:
    """slurm/eval.sbatch: ``tpe-ckpt average RUN --out OUT`` then ``tpe-eval --checkpoint OUT --out OUT``;
    run again (a requeue), the average replaces the export with the figures tpe-eval added to it."""
    out = run_dir / "averaged-last2"
    job: list[Callable[[], int]] = [
        lambda: ckpt_main(["average", str(run_dir), "--last", "2", "--out", str(out)]),
        lambda: eval_main(["--checkpoint", str(out), "--split", "validation", "--json", "--out", str(out)]),
    ]
    try:
        assert [step() for step in job] == [0, 0]
        found = marker(out)
        assert found is not None and "eval.json" in found["files"] and found["also"] == ["tpe-eval"]
        first = snapshot(out)
        assert [step() for step in job] == [0, 0]
        assert snapshot(out).keys() == first.keys() and json.loads((out / "eval.json").read_text())
        (out / "notes.txt").write_text("mine")  # now the folder holds a user's file: refused, kept
        assert job[0]() == 2 and (out / "notes.txt").read_text() == "mine"
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_an_export_written_before_markers_is_replaced_but_not_with_extra_files(
    run_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "old-export"
    shutil.copytree(run_dir / "checkpoint", out)
    (out / MARKER).unlink()  # as an earlier version wrote it
    assert ckpt_main(argv("export", run_dir, out, step=2)) == 0
    assert json.loads((out / "meta.json").read_text())["step"] == 2 and marker(out) is not None
    (out / MARKER).unlink()
    (out / "thesis.txt").write_text("x")
    assert ckpt_main(argv("export", run_dir, out)) == 2 and (out / "thesis.txt").is_file()


def test_prune_removes_its_own_temporaries_and_leaves_what_it_cannot_read(
    run_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = shutil.copytree(run_dir / "checkpoints", tmp_path / "checkpoints")
    newer = root / "step-00000010"  # a manifest of a format a newer version writes
    shutil.copytree(root / "step-00000004", newer)
    manifest = json.loads((newer / "manifest.json").read_text())
    (newer / "manifest.json").write_text(json.dumps({**manifest, "format": "tpe-train-checkpoint/9"}))
    coming = root / "step-00000012"  # a copy still coming in: files, no manifest yet
    coming.mkdir()
    (coming / "model-00000.safetensors").write_bytes(b"partial")
    own = root / ".tmp-step-00000014"  # the save protocol's own unfinished temporary
    own.mkdir()
    (own / "trainer.json").write_text("{")
    with caplog.at_level(logging.WARNING, logger="tpe_train"):
        removed = prune(root, keep_last=1, keep_every=0)
    assert sorted(p.name for p in removed) == [".tmp-step-00000014", "step-00000002"]
    assert newer.is_dir() and coming.is_dir() and (root / "step-00000004").is_dir()
    text = caplog.text
    assert f"not pruning {newer}: a manifest of format 'tpe-train-checkpoint/9'" in text
    assert f"not pruning {coming}: no manifest" in text


@pytest.mark.integration
def test_reshard_writes_a_new_run_directory_or_replaces_its_own(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = str(run_dir / "checkpoints" / "step-00000004")
    launch = str(ROOT / "configs" / "accelerate" / "cpu_single.yaml")

    def reshard(out: Path, config_file: str = launch) -> int:
        return ckpt_main(["reshard", checkpoint, "--config_file", config_file, "--out", str(out)])

    mydocs = tmp_path / "mydocs"
    mydocs.mkdir()
    (mydocs / "thesis.txt").write_text("chapter one\n")
    other = shutil.copytree(run_dir, tmp_path / "other-run")
    before = snapshot(other)
    assert reshard(mydocs) == 2 and reshard(other) == 2  # refused before anything starts
    err = capsys.readouterr().err
    assert "thesis.txt" in err and f"--out {other} is a run directory" in err
    assert snapshot(mydocs) == {"thesis.txt": b"chapter one\n"} and snapshot(other) == before
    out = tmp_path / "resharded"
    assert reshard(out) == 0
    first = snapshot(out)
    assert marker(out)["kind"] == "reshard" and "checkpoints/step-00000004/manifest.json" in first
    with pytest.raises(SystemExit):  # the trainer fails (no such launch file): the earlier one is back
        reshard(out, str(tmp_path / "missing.yaml"))
    assert snapshot(out) == first and leftovers(tmp_path) == []
    assert reshard(out) == 0 and leftovers(tmp_path) == []
    assert marker(out)["kind"] == "reshard" and (out / "checkpoints" / "step-00000004").is_dir()
    # a run directory to go on with: its own exports go inside it; a third reshard then refuses it
    assert ckpt_main(["average", str(out), "--last", "1", "--out", str(out / "averaged-last1")]) == 0
    assert reshard(out) == 2 and "averaged-last1/" in capsys.readouterr().err


DATA = ["data.synthetic.train_size=100", "data.synthetic.valid_size=6", "data.synthetic.test_size=6",
        "data.synthetic.long_size=0", "data.synthetic.probe_size=4", "data.vocab_size=60"]  # fmt: skip


def test_tpe_data_prepare_writes_only_its_own_store_folder(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from datasets import Dataset

    from tpe_train.data.cli import main as data_main
    from tpe_train.data.specs import store_path

    def prepare(root: Path, *extra: str) -> int:
        return data_main(["prepare", *DATA, f"data.store_dir={root}", *extra])

    taken = store_path(load_config("demo", [*DATA, f"data.store_dir={tmp_path / 'a'}"]).data)
    taken.mkdir(parents=True)
    (taken / "thesis.txt").write_text("chapter one\n")
    assert prepare(tmp_path / "a") == 2  # the store's own path holds a user's folder: refused, kept
    assert f"{taken} exists but is not a token store" in capsys.readouterr().err
    assert snapshot(taken) == {"thesis.txt": b"chapter one\n"}
    other = shutil.copytree(run_dir, tmp_path / "other-run")  # a run directory as data.store_dir
    before = snapshot(other)
    assert prepare(other) == 0
    store = store_path(load_config("demo", [*DATA, f"data.store_dir={other}"]).data)
    lock = f".{store.name}.lock"  # the store's build lock beside it (data/store.py), empty
    assert {k: v for k, v in snapshot(other).items() if not k.startswith((store.name, lock))} == before
    assert marker(store)["kind"] == "token-store"
    built = snapshot(store)
    assert prepare(other) == 0 and snapshot(store) == built  # again: reused as it is
    save = Dataset.save_to_disk

    def full_disk(self: Dataset, path: str, **kw: object) -> None:
        if path.endswith("valid"):
            raise OSError(28, "No space left on device")
        save(self, path, **kw)

    monkeypatch.setattr(Dataset, "save_to_disk", full_disk)
    with pytest.raises(OSError, match="No space left"):
        prepare(other, "data.vocab_size=70")  # another store, failing midway
    assert snapshot(store) == built and leftovers(other) == []
    assert sorted(p.name for p in other.iterdir() if p.name.startswith("synthetic-")) == [store.name]


def small_study(root: Path, bleu: float = 10.0) -> Path:
    """A study of one setting and seed whose run has figures (no training)."""
    from tpe_train.study.grid import Study, parse_setting

    study = Study(root, "demo", settings=["rope"], seeds=[1])
    study.save()
    path = study.eval_path(parse_setting("rope"), 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    figures = {"bleu": bleu, "chrf": 2 * bleu, "exact_match": 0.1, "probe_accuracy": None, "probe_pairs": 0,
               "test_sentences": 4, "bleu_by_length": {}, "bleu_signature": "nrefs:1"}  # fmt: skip
    path.write_text(json.dumps(figures))
    return root


@pytest.mark.slow
def test_the_study_report_replaces_only_an_earlier_report(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tpe_train.study import report
    from tpe_train.study.cli import main as study_main

    root = small_study(tmp_path / "study")
    folder = root / "report"
    folder.mkdir()
    (folder / "thesis.txt").write_text("chapter one\n")
    assert study_main(["report", str(root)]) == 2
    assert f"--out {folder} exists and holds files" in capsys.readouterr().err
    assert snapshot(folder) == {"thesis.txt": b"chapter one\n"}
    shutil.rmtree(folder)
    shutil.copytree(run_dir, folder)  # a run directory where the report goes
    before = snapshot(folder)
    assert study_main(["report", str(root)]) == 2 and snapshot(folder) == before
    assert "is a run directory" in capsys.readouterr().err
    shutil.rmtree(folder)
    assert study_main(["report", str(root)]) == 0
    first = snapshot(folder)
    assert marker(folder)["kind"] == "study-report" and "| `rope` | 1 | 10.00" in first["report.md"].decode()
    small_study(root, bleu=20.0)
    assert study_main(["report", str(root)]) == 0
    assert "| `rope` | 1 | 20.00" in (folder / "report.md").read_text()
    assert len(list((folder / "tb").glob("events.out.tfevents.*"))) == 1 and leftovers(root) == []
    second = snapshot(folder)
    small_study(root, bleu=30.0)
    monkeypatch.setattr(report, "summary", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(OSError, match="No space left"):
        study_main(["report", str(root)])
    assert snapshot(folder) == second and leftovers(root) == []
    (folder / MARKER).unlink()  # a report written before markers: still replaced
    monkeypatch.undo()
    assert study_main(["report", str(root)]) == 0 and marker(folder) is not None


@pytest.mark.slow
def test_a_study_archive_refuses_what_is_not_an_archive_and_keeps_whole_files(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tpe_train.study import archive
    from tpe_train.study.cli import main as study_main

    root = small_study(tmp_path / "study")
    mydocs = tmp_path / "mydocs"
    mydocs.mkdir()
    (mydocs / "thesis.txt").write_text("chapter one\n")
    other = shutil.copytree(run_dir, tmp_path / "other-run")
    before = snapshot(other)
    for dest in (mydocs, other, root / "archive"):
        assert study_main(["archive", str(root), str(dest)]) == 2
        assert "nothing was written" in capsys.readouterr().err or not (root / "archive").exists()
    assert snapshot(mydocs) == {"thesis.txt": b"chapter one\n"} and snapshot(other) == before
    assert not (root / "report").exists()  # refused before the study's report was written
    dest = tmp_path / "archive"
    assert study_main(["archive", str(root), str(dest)]) == 0
    assert marker(dest / "report")["command"] == "tpe-study archive"
    (dest / "report" / "thesis.txt").write_text("mine")  # a user's file in the archive's report: refused
    assert study_main(["archive", str(root), str(dest)]) == 2 and (dest / "report" / "thesis.txt").is_file()
    (dest / "report" / "thesis.txt").unlink()
    first = snapshot(dest)
    small_study(root, bleu=20.0)  # the run's figures change; archiving fails while the report is copied
    copy = archive._copy

    def failing(src: Path, dst: Path) -> None:
        if "report" in dst.parent.name:
            raise OSError(28, "No space left on device")
        copy(src, dst)

    monkeypatch.setattr(archive, "_copy", failing)
    with pytest.raises(OSError, match="No space left"):
        study_main(["archive", str(root), str(dest)])
    now = snapshot(dest)  # every file whole (the run's figures already the new ones), the report earlier
    assert now.keys() == first.keys() and leftovers(dest) == [] and leftovers(dest / "report") == []
    assert {k: v for k, v in now.items() if k.startswith("report/")} == {
        k: v for k, v in first.items() if k.startswith("report/")
    }
    assert json.loads(now["runs/s1/rope/eval.json"])["bleu"] == 20.0


CHILD = """
import os, signal, sys
from pathlib import Path
from tpe_train.run import outputs

out, stage = Path(sys.argv[1]), sys.argv[2]
rename = os.rename
calls = []

def killed_midway(a, b):  # the swap's second rename: the old output aside, the new one not in place
    calls.append(a)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    rename(a, b)

outputs._exchange = lambda a, b: False  # the two-rename swap, where a kill can fall between them
os.rename = killed_midway
with outputs.written_directory(out, "test", "export") as tmp:
    (tmp / "weights").write_text("new")
    if stage == "writing":
        os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.integration
@pytest.mark.parametrize("stage", ["writing", "swapping"])
def test_a_writer_killed_midway_leaves_the_earlier_output_or_puts_it_back(stage: str, tmp_path: Path) -> None:
    import subprocess
    import sys

    from tpe_train.run.outputs import recover, written_directory

    out = tmp_path / "exported"
    with written_directory(out, "test", "export") as tmp:
        (tmp / "weights").write_text("old")
    first = snapshot(out)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(out), stage], cwd=ROOT, timeout=60)
    assert proc.returncode == -9
    # killed while writing: the half-built folder beside it; while swapping: the old one aside too
    assert len(leftovers(tmp_path)) == (1 if stage == "writing" else 2)
    assert out.exists() == (stage == "writing")
    recover(out)  # what the next writer of the folder does first
    assert snapshot(out) == first and leftovers(tmp_path) == []
