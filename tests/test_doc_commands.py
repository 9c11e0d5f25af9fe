"""Every command the README and docs/ show works as written (the extraction: ``support/docs.py``).

- ``tpe-train`` (also as ``python -m tpe_train.train`` and under ``accelerate launch ... -m
  tpe_train.train``) runs in this process with ``--print-config``: the real config loader loads and
  validates the preset and every ``key=value`` override, without training.
- ``tpe-launch run|submit`` runs with ``--dry-run`` (the job script is rendered, nothing starts).
- ``tpe-data``, ``tpe-study run`` parse with their real parsers, and their preset and overrides load.
- ``tpe-eval``, ``tpe-translate``, ``tpe-ckpt`` and the other ``tpe-study`` commands parse with their
  real parsers; the ``tpe-ckpt`` commands on the demo's run directory also run, on a tiny trained
  run directory put where the docs' one is.
- ``python benchmarks/X.py`` and ``python -m benchmarks.gpu.X``: the script exists and has every
  option given (the benchmarks' smoke test runs them); ``bash``/``sbatch`` name an existing file.
- A file the command names exists in the repository, and no command needs a folder outside it (only
  the project's own machines have one) without saying so through an option.
- Code spans of the prose (`` `tpe-translate --length-penalty 0` ``) use only options their command's
  real parser has.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.docs import ROOT, Command, commands, console_scripts, inline_commands

COMMANDS = commands()
INLINE = inline_commands()


class Parsed(Exception):
    """Raised by the patched ``parse_known_args``: the parser and the arguments, nothing run."""

    def __init__(self, parser: argparse.ArgumentParser, args: list[str]) -> None:
        super().__init__()
        self.parser = parser
        self.argv = args


def entry_point(name: str) -> Any:
    """The ``main(argv)`` of a console script (``tpe-train``'s entry reads sys.argv: its ``main``)."""
    module, _, function = console_scripts()[name].partition(":")
    return getattr(importlib.import_module(module), "main" if function == "entry" else function)


def parser_of(monkeypatch: pytest.MonkeyPatch, name: str, argv: list[str]) -> Parsed:
    """Run a console script's ``main`` until the first parser parses; its parser and arguments."""

    def stop(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        raise Parsed(self, list(args if args is not None else sys.argv[1:]))

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_known_args", stop)
        try:
            entry_point(name)(argv)
        except Parsed as parsed:
            return parsed
    raise AssertionError(f"{name} {shlex.join(argv)} parsed nothing")


def parse_only(monkeypatch: pytest.MonkeyPatch, name: str, argv: list[str]) -> argparse.Namespace:
    """``name argv`` parsed by the script's own parser (an argparse error exits 2)."""
    parsed = parser_of(monkeypatch, name, argv)
    try:  # the scripts with options after their overrides parse intermixed
        return parsed.parser.parse_intermixed_args(parsed.argv)
    except TypeError:  # subcommands: argparse cannot intermix them
        return parsed.parser.parse_args(parsed.argv)


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """The options of a parser and of its subcommands."""
    found: set[str] = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action.choices, dict):
            for sub in action.choices.values():
                if isinstance(sub, argparse.ArgumentParser):
                    found |= option_strings(sub)
    return found


def options_of(monkeypatch: pytest.MonkeyPatch, name: str, args: list[str]) -> set[str]:
    """The options a fragment's command accepts: its parser's, or, where the script picks a
    subcommand's parser by hand (``COMMANDS`` of its module) and the fragment names none or several
    (``run|submit``), those of every one it may mean."""
    words = [w for w in args if not w.startswith("-")]
    module = importlib.import_module(console_scripts()[name].partition(":")[0])
    subcommands = list(getattr(module, "COMMANDS", {}))
    if subcommands:
        named = [c for c in (words[0].split("|") if words else []) if c in subcommands] or subcommands
        found: set[str] = set()
        for sub in named:
            with contextlib.suppress(AssertionError):  # a subcommand without options (no parser)
                found |= option_strings(parser_of(monkeypatch, name, [sub]).parser)
        return found
    return option_strings(parser_of(monkeypatch, name, args).parser)


def print_config(argv: list[str]) -> None:
    """``tpe-train ARGV --print-config``, in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = entry_point("tpe-train")([*argv, "--print-config"])
    assert code == 0, f"tpe-train {shlex.join(argv)} --print-config: {err.getvalue().strip()}"
    assert "model:" in out.getvalue()


def load(preset: str, overrides: list[str]) -> None:
    from tpe_train.config import load_config

    load_config(preset, overrides)  # a ConfigError names the key


def check_benchmark(argv: list[str]) -> None:
    """The script exists and has every option the command gives it: the option's string is in the
    script or in a module of its folder that it imports (the benchmarks' smoke test runs them)."""
    script = ROOT / argv[1]
    assert script.is_file(), f"{argv[1]} does not exist"
    if argv[1].startswith("benchmarks/"):
        text = script.read_text()
        for name in re.findall(r"^(?:from|import) ([\w.]+)", text, re.M):
            for folder in (script.parent, ROOT / "benchmarks", ROOT):  # its folder's, or by package
                module = folder.joinpath(*name.split(".")).with_suffix(".py")
                if module.is_file():
                    text += module.read_text()
                    break
        for word in argv[2:]:
            if word.startswith("--"):
                assert f'"{word.split("=")[0]}"' in text, f"{argv[1]} has no option {word}"
        # the default of --data is a folder only the project's own machines have
        if '"--data"' in script.read_text() and not {"--data", "--dry-run"} & set(argv):
            raise AssertionError(f"{argv[1]} reads its data from --data: pass it, and say how to get it")


def check_paths(argv: list[str]) -> None:
    """Repository files the command names exist; nothing outside the repository is named."""
    for word in argv[1:]:
        value = word.split("=", 1)[1] if "=" in word else word
        assert not value.startswith(("../", "/")), (
            f"{shlex.join(argv)} names {value}, outside the repository: a reader does not have it"
        )
        if re.match(r"(configs|benchmarks|slurm|launcher|tests|tpe_train)/\S+\.\w+$", value):
            assert (ROOT / value).is_file(), f"{shlex.join(argv)}: {value} does not exist"


def run_command(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> str:
    """Check one documented command; returns its kind (for the coverage test)."""
    name, args = argv[0], argv[1:]
    check_paths(argv)
    if name == "accelerate":
        assert args[:1] == ["launch"] and "-m" in args, argv
        module = args[args.index("-m") + 1]
        assert module == "tpe_train.train", f"accelerate launch runs {module}"
        print_config(args[args.index("-m") + 2 :])
        return "accelerate"
    if name in ("bash", "sbatch"):
        script = next(w for w in args if not w.startswith("-"))
        assert (ROOT / script).is_file(), f"{name} {script}: no such file in the repository"
        return "script"
    if name.startswith("python"):
        if args[:1] == ["-m"]:
            module, rest = args[1], args[2:]
            if module.startswith("benchmarks."):  # the GPU checks run as modules
                check_benchmark([name, module.replace(".", "/") + ".py", *rest])
                return "script"
            if module == "tpe_train.evaluation" and rest[:1] == ["translate"]:
                return run_command(["tpe-translate", *rest[1:]], monkeypatch)
            scripts = {"tpe_train.evaluation": "tpe-eval"}  # the package runs tpe-eval's main
            for script, target in console_scripts().items():  # X.cli and X run script's main
                path = target.partition(":")[0]
                scripts.setdefault(path, script)
                scripts.setdefault(path.removesuffix(".cli"), script)
            assert module in scripts, f"python -m {module}: a module this test does not know; teach it"
            return run_command([scripts[module], *rest], monkeypatch)
        check_benchmark(argv)
        return "script"
    if name == "tpe-train":
        print_config(args)
    elif name == "tpe-launch":
        assert args[:1] in (["run"], ["submit"]), f"tpe-launch {args[:1]} has no dry run"
        for var in [v for v in os.environ if v.startswith("SLURM_")] + ["CUDA_VISIBLE_DEVICES"]:
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("TPE_SLURM_CONFIG", "")  # no site file of whoever runs the tests
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = entry_point(name)([*args, "--dry-run"])
        assert code == 0, f"tpe-launch {shlex.join(args)} --dry-run: {err.getvalue().strip()}"
    elif name in console_scripts():
        ns = parse_only(monkeypatch, name, args)
        if name in ("tpe-data", "tpe-study") and hasattr(ns, "preset") and hasattr(ns, "overrides"):
            load(ns.preset, ns.overrides)
        if name == "tpe-study" and args[:1] == ["run"]:
            from tpe_train.study.grid import parse_seeds, parse_setting

            for setting in ns.encodings.split(","):
                parse_setting(setting)
            parse_seeds(ns.seeds)
    else:
        raise AssertionError(f"{name}: a command this test does not know; teach it")
    return name


@pytest.mark.parametrize("command", COMMANDS, ids=[c.id for c in COMMANDS])
def test_documented_command_runs(command: Command, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the commands are documented from the repository root
    for name, value in command.env:
        check_paths(["env", f"{name}={value}"])
        monkeypatch.setenv(name, value)
    try:
        run_command(list(command.argv), monkeypatch)
    except SystemExit as stop:  # argparse's error, printed on stderr
        pytest.fail(f"{command.id}: {shlex.join(command.argv)}: exit {stop.code}")


@pytest.mark.parametrize("command", INLINE, ids=[c.id for c in INLINE])
def test_options_in_the_prose_exist(command: Command, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fragment such as `tpe-eval --compare B` gives only options its command has."""
    name, args = command.argv[0], list(command.argv[1:])
    known = options_of(monkeypatch, name, args)
    unknown = [w for w in args if w.startswith("--") and w.split("=")[0] not in known]
    assert not unknown, f"{command.id}: {shlex.join(command.argv)}: {name} has no option {unknown}"


def test_the_command_check_sees_every_kind_of_command() -> None:
    """The extraction is not silently empty: every console script is documented and checked."""
    kinds = {c.argv[0] for c in COMMANDS} | {
        "script" for c in COMMANDS if c.argv[0].startswith("python") and c.argv[1].endswith(".py")
    }
    assert set(console_scripts()) | {"accelerate", "script"} <= kinds, sorted(kinds)
    assert sum(c.argv[0] == "tpe-train" for c in COMMANDS) >= 10
    assert len(INLINE) >= 10


def test_the_extraction_reads_continuations_prompts_comments_and_variables(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```console\n$ tpe-eval --checkpoint a \\\n    --json   # scores\nbleu 12.0\n```\n"
        "```bash\nW=work\nA=1 tpe-train data.path=$W/x && pip install x\n```\n"
        "```text\ntpe-train not.a.command\n```\n"
        "text `tpe-translate --beam 2` and `tpe-eval`\n"
    )
    got = [(c.line, c.env, c.argv) for c in commands([page])]
    assert got == [
        (2, (), ("tpe-eval", "--checkpoint", "a", "--json")),
        (8, (("A", "1"),), ("tpe-train", "data.path=work/x")),
    ]
    assert [c.argv for c in inline_commands([page])] == [("tpe-translate", "--beam", "2")]


# --------------------------------------------------------------------------------------------------
# The tpe-ckpt commands on the demo's run directory (README, checkpoints.md), run on a tiny one

DEMO_RUN = "runs/demo-sinusoidal-s1"
TINY = [
    "data.synthetic.train_size=300",
    "data.synthetic.test_size=10",
    "data.synthetic.valid_size=10",
    "data.synthetic.long_size=4",
    "data.synthetic.probe_size=4",
    "model.d_model=32",
    "model.n_heads=2",
    "model.ffn_dim=64",
    "model.encoder_layers=1",
    "model.decoder_layers=1",
    "eval.at_end=false",
    "train.valid_bleu_size=0",
    "train.progress=false",
    "train.threads=1",
    "train.max_steps=5",
    "train.save_every=1",
    "train.keep_last=5",
]


@pytest.mark.integration
def test_the_tpe_ckpt_commands_of_the_demo_run_run_on_a_tiny_run(tmp_path: Path) -> None:
    from tpe_train.ckpt import cli, commands

    documented = [c for c in COMMANDS if c.argv[0] == "tpe-ckpt" and DEMO_RUN in " ".join(c.argv)]
    assert {c.argv[1] for c in documented} >= {"list", "average", "export", "reshard"}
    run = tmp_path / DEMO_RUN
    cmd = [sys.executable, "-m", "tpe_train.train", *TINY, f"train.run_dir={run}"]
    trained = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    latest = run / "checkpoints" / "latest"  # the pointer file names a checkpoint as well
    assert (
        commands._checkpoint(latest)
        == commands._checkpoint(run)
        == run / "checkpoints" / latest.read_text().strip()
    )
    for command in documented:
        argv = list(command.argv[1:])
        if argv[0] == "reshard":  # two ranks under accelerate: too slow here; its source resolves
            checkpoint = parse_only(pytest.MonkeyPatch(), "tpe-ckpt", argv).checkpoint
            assert commands._checkpoint(tmp_path / checkpoint).parent == run / "checkpoints", command.id
            continue
        with contextlib.chdir(tmp_path), contextlib.redirect_stdout(io.StringIO()):
            code = cli.main(argv)
        assert code in (0, None), f"{command.id}: tpe-ckpt {shlex.join(argv)} exited {code}"
