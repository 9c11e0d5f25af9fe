"""Position encodings from the user's own package (``tpe_train.positions`` entry points), installed for
real with pip into a folder on PYTHONPATH and run through every command that takes an encoding:
tpe-train, the Slurm sweep and its array index, tpe-study (local and on Slurm), and export's refusal;
and the packages whose entry points cannot be used."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from launcher.plan import POSITION_SWEEP
from tests.support.plugin_pkg import TINY, command, env_with, install_bad, install_good, run
from tpe_train.positions import POSITIONS

pytestmark = pytest.mark.integration  # every test here starts the project's commands

BUILTINS = POSITION_SWEEP  # the built-ins, in the sweep's fixed order


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return env_with(install_good(tmp_path_factory.mktemp("plugin")))


@pytest.fixture(scope="module")
def trained(good: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("train") / "run"
    proc = run([*command("tpe-train"), "--preset", "demo", *TINY, "model.position.kind=scaled",
                f"train.run_dir={out}"], good)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out


def test_the_test_environment_has_no_plugin() -> None:
    assert "scaled" not in POSITIONS and set(POSITIONS.names()) == set(BUILTINS)


def test_tpe_train_trains_the_plugin_encoding(trained: Path) -> None:
    assert "kind: scaled" in (trained / "config.yaml").read_text()
    state = load_file(str(trained / "checkpoint" / "model.safetensors"))
    gains = sorted(k for k in state if k.endswith("positions.0.gain"))  # the plugin's own parameter
    assert gains == ["decoder.positions.0.gain", "encoder.positions.0.gain"], sorted(state)[:10]
    assert (trained / "eval.json").is_file() or (trained / "checkpoint" / "meta.json").is_file()


def test_export_refuses_the_plugin_encoding_naming_it_and_why(trained: Path, good: dict[str, str]) -> None:
    for fmt, form in (("ctranslate2", "CTranslate2"), ("hf", "transformers")):
        out = trained.parent / f"export-{fmt}"
        proc = run([*command("tpe-ckpt"), "export", str(trained), "--format", fmt, "--out", str(out)], good)
        assert proc.returncode != 0, proc.stdout[-2000:]
        message = " ".join((proc.stdout + proc.stderr).split())
        assert "'scaled' (entry point scaled = mypos.enc:ScaledSinusoid of package mypos" in message, message
        assert f"has no {form} form" in message and "--format native" in message, message
        assert not out.exists()


def test_the_sweep_appends_the_plugin_after_the_builtins_and_the_job_maps_its_index(
    good: dict[str, str], tmp_path: Path
) -> None:
    submit = [
        *command("tpe-launch"),
        "submit",
        "--script",
        "sweep_positions",
        "--preset",
        "demo",
        "--dry-run",
    ]
    proc = run([*submit, "--sweep-root", str(tmp_path / "sweep")], good, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "#SBATCH --array=0-13" in proc.stdout
    assert "6 rope 7 kerple_log 8 kerple_power 9 sandwich 10 fire 11 xpos 12 cope 13 scaled" in proc.stdout
    assert f"# run dir [13] scaled: {tmp_path / 'sweep' / 'scaled'}" in proc.stdout
    assert "--kinds " + ",".join([*BUILTINS, "scaled"]) in proc.stdout
    # the user's own choice of kinds: the array covers it, index -> kind in that order
    proc = run([*submit, "--kinds", "scaled,rope", "--sweep-root", str(tmp_path / "two")], good, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "#SBATCH --array=0-1" in proc.stdout and "0 scaled 1 rope" in proc.stdout
    # in the job: SLURM_ARRAY_TASK_ID picks the kind, by the submitted --kinds or the default sweep
    env = {**good, "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node1", "SLURM_ARRAY_TASK_ID": "1"}
    proc = run([*command("tpe-launch"), "run", "--sweep", "positions", "--sweep-root", str(tmp_path),
                "--kinds", "rope,scaled", "--preset", "demo", "--dry-run"], env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"model.position.kind=scaled train.run_dir={tmp_path / 'scaled'}" in proc.stdout, proc.stdout
    code = "import os; from launcher.plan import sweep_kind; "
    code += "print(sweep_kind(int(os.environ['SLURM_ARRAY_TASK_ID'])))"
    proc = run([sys.executable, "-c", code], {**good, "SLURM_ARRAY_TASK_ID": "13"})
    assert proc.stdout.strip() == "scaled", proc.stderr


def test_tpe_study_plans_the_plugin_locally_and_submits_its_array_index(
    good: dict[str, str], tmp_path: Path
) -> None:
    study = [
        *command("tpe-study"),
        "run",
        "--preset",
        "demo",
        "--encodings",
        "scaled,sinusoidal",
        "--seeds",
        "1",
    ]
    proc = run([*study, "--out", str(tmp_path / "slurm"), "--slurm", "--slurm-args", "--time 1:00:00",
                "--dry-run", *TINY], good, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "#SBATCH --array=13,1" in proc.stdout, proc.stdout[-3000:]
    # locally: the same runs as tpe-train commands (test_tpe_train_trains_the_plugin_encoding runs one)
    proc = run([*study, "--out", str(tmp_path / "local"), "--dry-run", *TINY], good, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "[1/2] scaled seed 1: " in proc.stdout and "model.position.kind=scaled" in proc.stdout, proc.stdout
    assert f"train.run_dir={tmp_path / 'local' / 'runs' / 's1' / 'scaled'}" in proc.stdout


def test_unusable_plugins_warn_once_and_asking_for_one_names_package_entry_point_and_fix(
    tmp_path_factory: pytest.TempPathFactory, good: dict[str, str]
) -> None:
    bad = env_with(install_bad(tmp_path_factory.mktemp("bad")), Path(good["PYTHONPATH"].split(":")[0]))
    train = [*command("tpe-launch"), "submit", "--preset", "demo", "--dry-run"]
    proc = run(train, bad)  # a built-in encoding trains; the warning lists the unusable plugins
    assert proc.returncode == 0, proc.stderr[-3000:]
    warning = " ".join(proc.stderr.split())
    assert warning.count("position-encoding plugins skipped") == 1, proc.stderr
    assert "entry point broken = badpos.broken:Thing of package badpos" in warning
    assert "importing it failed (ModuleNotFoundError: No module named 'mypos_missing_dependency')" in warning
    assert "entry point rope = badpos.other:fn of package badpos" in warning
    assert "its name is already a built-in encoding's; rename the entry point" in warning
    assert "notenc = badpos.other:fn" in warning and "not a subclass of" in warning
    for kind, why in (("broken", "importing it failed"), ("notenc", "not a subclass")):
        proc = run([*command("tpe-train"), "--preset", "demo", f"model.position.kind={kind}"], bad)
        assert proc.returncode != 0
        message = " ".join(proc.stderr.split())
        assert f"model.position.kind='{kind}': the position encoding of entry point {kind} = " in message
        assert "of package badpos" in message and why in message, message
    # the default sweep holds them (13 broken, 14 notenc, 15 scaled: every installed name keeps its index)
    proc = run([*command("tpe-launch"), "submit", "--script", "sweep_positions", "--preset", "demo",
                "--array", "13", "--dry-run"], bad)  # fmt: skip
    assert proc.returncode != 0 and "sweep element broken: " in proc.stderr, proc.stderr
    assert "choose the encodings the sweep runs with --kinds" in proc.stderr
    # the good plugin next to them still trains through the config
    code = "from tpe_train.config import load_config; "
    code += "print(load_config('demo', ['model.position.kind=scaled']).model.position.kind)"
    proc = run([sys.executable, "-c", code], bad)
    assert proc.stdout.strip() == "scaled", proc.stderr
