"""Job scripts that no value can escape, and a site's own sbatch options, through the real parser of
``tpe-launch submit --dry-run`` (in-process).

Each rendered script passes ``bash -n``; its ``#SBATCH`` block, read the way sbatch reads it (the lines
before the first line that is neither blank nor a comment), is exactly the options asked for; and its
commands, run by bash with the launcher's programs replaced by ``printf``, receive exactly the preset and
overrides given, while no command hidden in a value runs (a canary file stays absent)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from launcher.cli import main
from launcher.sbatch import DEFAULT_CPUS_PER_GPU, extra_option, sbatch_block, sbatch_value, sbatch_words

HOSTILE = 'it\'s "q" $(touch CANARY) `touch CANARY` sp  ace # not a comment \\ back'
NEWLINE = "x\ntouch CANARY\n#"


def dry_run(argv: list[str], capsys: pytest.CaptureFixture[str], cwd: Path) -> str:
    """The dry-run output of ``tpe-launch submit`` run in ``cwd``."""
    old = Path.cwd()
    os.chdir(cwd)
    try:
        code = main(["submit", *argv, "--dry-run"])
    finally:
        os.chdir(old)
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def refused(argv: list[str], capsys: pytest.CaptureFixture[str], cwd: Path) -> str:
    """The one-paragraph error of ``tpe-launch submit`` run in ``cwd`` (exit 2, nothing on stdout)."""
    old = Path.cwd()
    os.chdir(cwd)
    try:
        code = main(["submit", *argv, "--dry-run"])
    finally:
        os.chdir(old)
    out, err = capsys.readouterr()
    assert code == 2 and not out, (out, err)
    assert err.count("\n") == 1 and "Traceback" not in err  # one paragraph
    return err


def script_of(out: str) -> str:
    return out.split("\n# --- tpe-launch submit --dry-run", 1)[0] + "\n"


def argv_run(script: str, tmp: Path) -> list[list[str]]:
    """The commands of the script's body as bash passes them: each launcher program replaced by a shell
    function that prints its argv; the script runs in ``tmp``, where a canary file shows injection."""
    body = re.sub(r"^(exec )?(tpe-launch|tpe-ckpt|tpe-eval) ", r"show \2 ", script, flags=re.M)
    body = "show() { printf '%s\\0' \"$@\"; printf '\\1'; }\n" + body
    proc = subprocess.run(["bash"], input=body, cwd=tmp, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp / "CANARY").exists(), "a value ran as a command"
    return [cmd.rstrip("\x00").split("\x00") for cmd in proc.stdout.split("\x01") if cmd]


def bash_n(text: str) -> None:
    proc = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_sbatch_words_read_values_as_sbatch_does() -> None:
    # as Slurm 22.05's sbatch read them back (scontrol show job, on the tests' cluster)
    assert sbatch_words(" --comment='x y#z' ") == ["--comment=x y#z"]
    assert sbatch_words(" --comment=plain#comment") == ["--comment=plain"]
    assert sbatch_words(' --comment="a\\"b"') == ['--comment=a"b']
    assert sbatch_words(" --comment='a\\b'") == ["--comment=ab"]  # backslash escapes inside quotes too
    for value in (HOSTILE, "a'b c\\d\"e", "plain", "é ü", "%j.out", "-x"):
        assert sbatch_words(" --comment=" + sbatch_value("v", value)) == ["--comment=" + value]
    for bad in ("a\nb", "a\rb", "tab\there", "nul\x00"):
        with pytest.raises(ValueError, match="control character"):
            sbatch_value("v", bad)


def preset_file(folder: Path, name: str, preset: str | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    lines = ["base: demo"] + ([f"preset: {preset}"] if preset else [])
    path.write_text("\n".join(lines) + "\n")
    return path


def test_hostile_presets_and_overrides_render_inert_scripts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A preset file in a folder named with quotes, $(...), backticks, spaces and a newline; overrides
    holding the same: the script parses, its #SBATCH block is exactly what was asked, the job's
    commands get the values verbatim, and none of them runs."""
    folder = tmp_path / "pre sets 'q' $(touch CANARY) `touch CANARY`\nx"
    preset = preset_file(folder, "it's a preset.yaml", "mine")
    run = tmp_path / "run dir 'q' $(touch CANARY) `x`#c \\ \"d\""
    overrides = [f"data.hub_config={HOSTILE}", f"data.hub_config={NEWLINE}", f"train.run_dir={run}"]
    argv = ["--preset", str(preset), "--time", "10", *overrides]
    out = dry_run(argv, capsys, tmp_path)
    script = script_of(out)
    bash_n(script)
    bash_n(out)  # the dry-run notes after the script are comments, whatever the overrides hold
    assert sbatch_block(script) == [
        "--job-name=tpe-mine", "--nodes=1", "--ntasks-per-node=1", f"--output={run}/slurm-%j.out",
        "--open-mode=append", f"--chdir={tmp_path}", "--signal=B:USR1@300", "--requeue", "--time=10",
    ]  # fmt: skip
    (cmd,) = argv_run(script, tmp_path)
    assert cmd[:4] == ["tpe-launch", "supervise", "--status-dir", str(run)]
    run_args = cmd[cmd.index("run") + 1 :]
    assert run_args[run_args.index("--preset") + 1] == str(preset)
    assert run_args[run_args.index("--") + 1 :] == overrides


def test_the_sweep_and_the_eval_scripts_quote_their_folders(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    root = tmp_path / "sweep $(touch CANARY) 'q'"
    out = dry_run(["--script", "sweep_positions", "--array", "0,6%1", "--sweep-root", str(root),
                   f"data.hub_config={HOSTILE}"], capsys, tmp_path)  # fmt: skip
    script = script_of(out)
    bash_n(script)
    block = sbatch_block(script)
    assert "--array=0,6%1" in block and f"--output={root}/slurm-%A_%a.out" in block
    (cmd,) = argv_run(script, tmp_path)
    assert cmd[cmd.index("--sweep-root") + 1] == str(root) and cmd[-1] == f"data.hub_config={HOSTILE}"
    run = tmp_path / "run `touch CANARY`"
    out = dry_run(["--script", "eval", "--last", "2", f"train.run_dir={run}"], capsys, tmp_path)
    script = script_of(out)
    bash_n(script)
    assert f"--output={run}/slurm-eval-%j.out" in sbatch_block(script)
    average, evaluate = argv_run(script, tmp_path)
    assert average == ["tpe-ckpt", "average", str(run), "--last", "2", "--out", str(run / "averaged-last2")]
    assert evaluate[:3] == ["tpe-eval", "--checkpoint", str(run / "averaged-last2")]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--job-name", "a b"], "job name 'a b' may hold only letters"),
        (["--job-name", "x\n#SBATCH --wrap=id"], "may hold only letters"),
        (["--time", "10\n#SBATCH --wrap=id"], "is not a Slurm time limit"),
        (["--partition", "gpu\ntouch CANARY"], "control character"),
        (["--account", "lab\r"], "control character"),
        (["--dependency", "afterok:1\n#SBATCH --x"], "control character"),
        (
            ["--script", "sweep_positions", "--sweep-root", "a\nb"],
            "/a\\nb/slurm-%A_%a.out' holds the control",
        ),
        (["--script", "sweep_positions", "--array", "0-1%2\ntouch CANARY"], "limit after % must be a number"),
        (["--sbatch", "comment=a\nb"], "control character"),
        (["--sbatch", "output=/tmp/x"], "--output is set by the launcher"),
        (["--sbatch", "out=/tmp/x"], "sbatch reads --out as --output"),
        (["--sbatch", "nodes=2"], "--nodes is set by --nodes"),
        (["--sbatch", "Comment=x"], "is not an sbatch long option"),
        (["--sbatch", "comment x=1"], "is not an sbatch long option"),
        (["--mem", "lots"], "is not a memory size"),
        (["--mail-type", "END,SOMETIMES"], "SOMETIMES is not a Slurm mail type"),
        (["--cpus-per-gpu", "4"], "--cpus-per-gpu applies to GPU nodes"),
        (["--gpus-per-node", "2", "--cpus-per-node", "16", "--cpus-per-gpu", "4"], "give one of them"),
    ],
)
def test_values_that_would_escape_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    err = refused(argv, capsys, tmp_path)
    assert message in err
    assert not (tmp_path / "CANARY").exists()


def test_preset_names_that_would_escape_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The preset's name names the run directory and the job: a newline, a space or a slash in it (from
    its `preset:` key or its file name) is refused at load, naming the fix."""
    for folder, name, key in (
        ("a", "x.yaml", '"x\\ntouch pwned\\n#"'),
        ("b", "x.yaml", '"../../elsewhere"'),
        ("c", "my preset.yaml", None),
        ("d", "-x.yaml", None),
    ):
        preset = preset_file(tmp_path / folder, name, key)
        err = refused(["--preset", str(preset)], capsys, tmp_path)
        named = "may hold only letters, digits and '._-'" in err and "set 'preset: NAME'" in err
        typed = "preset takes letters, digits and ._-" in err  # a control character: the text type's check
        assert named or typed, err
    assert not list(tmp_path.glob("runs*")) and not (tmp_path / "pwned").exists()


def site_block(block: list[str]) -> list[str]:
    """The options after the launcher's own (``--time`` onwards)."""
    return block[block.index("--time=10") :]


def test_site_options_render_in_the_block_and_the_setup_before_the_launch(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    setup = tmp_path / "site setup.sh"
    setup.write_text("module load cuda/12.4  # the site's modules\nsource /opt/venv/bin/activate\n")
    out = dry_run(
        ["--nodes", "2", "--gpus-per-node", "8", "--time", "10", "--qos", "high", "--mem", "64G",
         "--constraint", "a100|h100", "--exclusive", "--mail-type", "END,FAIL", "--mail-user", "me@lab.org",
         "--partition", "gpu", "--account", "my lab", "--sbatch", "comment=it's $(mine)", "--sbatch", "hold",
         "--sbatch", "gres-flags=enforce-binding", "--setup", str(setup), f"train.run_dir={tmp_path}/r"],
        capsys, tmp_path,
    )  # fmt: skip
    script = script_of(out)
    bash_n(script)
    block = sbatch_block(script)
    assert f"--cpus-per-gpu={DEFAULT_CPUS_PER_GPU}" in block and "--gpus-per-node=8" in block
    assert site_block(block) == [
        "--time=10", "--partition=gpu", "--account=my lab", "--qos=high", "--mem=64G",
        "--constraint=a100|h100", "--mail-type=END,FAIL", "--mail-user=me@lab.org", "--exclusive",
        "--comment=it's $(mine)", "--hold", "--gres-flags=enforce-binding",
    ]  # fmt: skip
    body = script.split("set -euo pipefail", 1)
    assert "module load cuda/12.4" in body[0] and "source /opt/venv/bin/activate" in body[0]
    assert "tpe-launch run" in body[1]  # the set-up runs first, then the launch


def test_cpus_asked_for_with_gpus_and_on_cpu_nodes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    def block(*argv: str) -> list[str]:
        return sbatch_block(script_of(dry_run([*argv, f"train.run_dir={tmp_path}/r"], capsys, tmp_path)))

    assert "--cpus-per-gpu=8" in block("--gpus-per-node", "4")
    assert "--cpus-per-gpu=12" in block("--gpus-per-node", "4", "--cpus-per-gpu", "12")
    assert not [w for w in block("--gpus-per-node", "4", "--cpus-per-gpu", "0") if w.startswith("--cpus")]
    gpu_node = block("--gpus-per-node", "4", "--cpus-per-node", "48")
    assert "--cpus-per-task=48" in gpu_node and not [w for w in gpu_node if w.startswith("--cpus-per-gpu")]
    assert "--cpus-per-task=4" in block("--gpus-per-node", "0", "--cpus-per-node", "4")
    out = dry_run(
        ["--gpus-per-node", "0", "--cpus-per-node", "4", f"train.run_dir={tmp_path}/r"], capsys, tmp_path
    )
    assert "export SRUN_CPUS_PER_TASK=4" in out  # srun does not pass sbatch's --cpus-per-task on (22.05+)


def test_site_file_sets_defaults_and_flags_win(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "cfg" / "tpe-train" / "slurm.yaml"
    site.parent.mkdir(parents=True)
    (site.parent / "setup.sh").write_text('echo site set-up > "$SLURM_SUBMIT_DIR/ran"\n')
    site.write_text(
        "partition: gpu\naccount: lab\nqos: normal\nmem: 0\ncpus-per-gpu: 6\nexclusive: true\n"
        "setup: setup.sh\nsbatch: [comment=site, 'gres-flags=enforce-binding']\n"
    )
    monkeypatch.delenv("TPE_SLURM_CONFIG")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    argv = ["--gpus-per-node", "2", "--time", "10", f"train.run_dir={tmp_path}/r"]
    script = script_of(dry_run(argv, capsys, tmp_path))
    block = sbatch_block(script)
    assert "--cpus-per-gpu=6" in block
    assert site_block(block) == [
        "--time=10", "--partition=gpu", "--account=lab", "--qos=normal", "--mem=0", "--exclusive",
        "--comment=site", "--gres-flags=enforce-binding",
    ]  # fmt: skip
    assert 'echo site set-up > "$SLURM_SUBMIT_DIR/ran"' in script
    flags = ["--partition", "big", "--no-exclusive", "--cpus-per-gpu", "10", "--sbatch", "comment=mine"]
    block = sbatch_block(script_of(dry_run([*argv, *flags], capsys, tmp_path)))
    assert "--cpus-per-gpu=10" in block
    assert site_block(block) == [
        "--time=10", "--partition=big", "--account=lab", "--qos=normal", "--mem=0",
        "--gres-flags=enforce-binding", "--comment=mine",
    ]  # fmt: skip
    monkeypatch.setenv("TPE_SLURM_CONFIG", str(site))  # the variable names the file itself
    assert "--partition=gpu" in sbatch_block(script_of(dry_run(argv, capsys, tmp_path)))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("partitoin: gpu\n", "unknown key 'partitoin'; valid keys are"),
        ("exclusive: yes please\n", "exclusive must be true or false"),
        ("cpus-per-gpu: -1\n", "cpus-per-gpu must be a whole number >= 0"),
        ("sbatch: [nodes=4]\n", "--nodes is set by --nodes"),
        ("- a list\n", "must be a YAML mapping"),
        ("time: 12:00:00\n", "time must be quoted, e.g. time: '12:00:00' (got 43200)"),
        ("partition: [gpu\n", "cannot read it as YAML"),
    ],
)
def test_bad_site_files_are_refused(
    text: str,
    message: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    site = tmp_path / "slurm.yaml"
    site.write_text(text)
    monkeypatch.setenv("TPE_SLURM_CONFIG", str(site))
    err = refused(["--gpus-per-node", "2"], capsys, tmp_path)
    assert message in err and str(site) in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("module load x\n#SBATCH --mem=4G\n", "line 2: '#SBATCH --mem=4G' is an #SBATCH line"),
        ("echo 'unclosed\n", "is not valid bash"),
    ],
)
def test_setup_files_that_would_break_the_script_are_refused(
    text: str, message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    setup = tmp_path / "setup.sh"
    setup.write_text(text)
    err = refused(["--setup", str(setup)], capsys, tmp_path)
    assert message in err
    assert "--setup" in refused(["--setup", str(tmp_path / "missing.sh")], capsys, tmp_path)


def test_extra_options_are_one_option_each() -> None:
    assert extra_option("mem-per-cpu=4G") == ("mem-per-cpu", "4G")
    assert extra_option("--hold") == ("hold", None)
    assert extra_option("comment=a=b") == ("comment", "a=b")
