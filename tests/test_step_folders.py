"""A checkpoint folder is known by its own contents (its manifest), not by its name or where it lies.

A ``step-…`` folder copied to another disk, into another run, or renamed (``best-so-far``, a name with
a space) is read by ``tpe-ckpt export`` and ``tpe-ckpt reshard``; ``tpe-eval`` and ``tpe-translate``,
which read exports, refuse it naming ``tpe-ckpt export``, and read the export made from it. A copy
that cannot be read is refused with the reason (a file missing, a save's temporary), never an
unknown one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tpe_train.ckpt.cli import main as tpe_ckpt
from tpe_train.ckpt.store import inspect
from tpe_train.evaluation.cli import eval_main, translate_main

pytestmark = pytest.mark.slow  # the shared checkpoint is trained in this process (tests/conftest.py)

ROOT = Path(__file__).parents[1]
STEP = "run/checkpoints/step-00000001"
#: where a copy goes: another parent and another name, another run's checkpoints under a name of no
#: step, and the name of another step
PLACES = ["elsewhere/my checkpoint", "other-run/checkpoints/best-so-far", "archive/step-00000099"]


def copied(tiny_step: Path, tmp_path: Path, place: str) -> Path:
    dest = tmp_path / place
    shutil.copytree(tiny_step / STEP, dest)
    return dest


def refusal(capsys: pytest.CaptureFixture[str], code: int, prog: str) -> str:
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"{prog}: error: ") and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and "unknown" not in err, err
    return err


@pytest.mark.parametrize("place", PLACES)
def test_a_copied_and_renamed_step_folder_is_exported(tiny_step: Path, tmp_path: Path, place: str) -> None:
    ckpt = copied(tiny_step, tmp_path, place)
    assert inspect(ckpt).complete and inspect(ckpt).step == 1  # the step is the manifest's, not the name's
    out = tmp_path / "out"
    assert tpe_ckpt(["export", str(ckpt), "--out", str(out)]) == 0
    assert json.loads((out / "meta.json").read_text())["step"] == 1
    assert (out / "model.safetensors").read_bytes() == (
        tiny_step / "run/checkpoint/model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize(
    ("place", "damage", "reason"),
    [
        (
            "elsewhere/mine",
            "trainer.json",
            "is incomplete (trainer.json missing, truncated or not a plain file)",
        ),
        ("elsewhere/mine", "manifest.json", "is neither a complete checkpoint nor a run directory with one"),
        (
            "elsewhere/.tmp-step-00000001",
            "",
            "is incomplete (a temporary of a save or a pruning that stopped)",
        ),
    ],
)
def test_a_copy_that_cannot_be_read_is_refused_with_the_reason(
    tiny_step: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], place: str, damage: str, reason: str
) -> None:
    ckpt = copied(tiny_step, tmp_path, place)
    if damage:
        (ckpt / damage).unlink()
    out = tmp_path / "out"
    for argv in (
        ["export", str(ckpt), "--out", str(out)],
        [
            "reshard",
            str(ckpt),
            "--config_file",
            str(ROOT / "configs/accelerate/cpu_single.yaml"),
            "--out",
            str(out),
        ],
    ):
        err = refusal(capsys, tpe_ckpt(argv), "tpe-ckpt")
        assert f"{ckpt} {reason}" in err
        assert not out.exists()


def test_eval_and_translate_refuse_a_step_folder_and_read_its_export(
    tiny_step: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = copied(tiny_step, tmp_path, PLACES[0])
    source = tmp_path / "source.txt"
    source.write_text("ein haus\n")
    translated = tmp_path / "translated.txt"
    commands = {
        "tpe-eval": lambda: eval_main(["--checkpoint", str(ckpt), "--limit", "2"]),
        "tpe-translate": lambda: translate_main(
            ["--checkpoint", str(ckpt), "-i", str(source), "-o", str(translated)]
        ),
    }
    for prog, run in commands.items():
        err = refusal(capsys, run(), prog)
        assert f"{ckpt} is a training checkpoint" in err and f"tpe-ckpt export '{ckpt}' --out DIR" in err
    assert not translated.exists()
    export = tmp_path / "exports" / "from a copy"
    assert tpe_ckpt(["export", str(ckpt), "--out", str(export)]) == 0
    assert eval_main(["--checkpoint", str(export), "--limit", "2"]) == 0
    assert translate_main(["--checkpoint", str(export), "-i", str(source), "-o", str(translated)]) == 0
    assert len(translated.read_text().splitlines()) == 1


@pytest.mark.integration
def test_reshard_reads_a_renamed_step_folder(tiny_step: Path, tmp_path: Path) -> None:
    ckpt = copied(tiny_step, tmp_path, PLACES[1])
    out = tmp_path / "resharded"
    launch = str(ROOT / "configs" / "accelerate" / "cpu_single.yaml")
    assert tpe_ckpt(["reshard", str(ckpt), "--config_file", launch, "--out", str(out)]) == 0
    entry = inspect(out / "checkpoints" / "step-00000001")
    assert entry.complete and entry.step == 1
