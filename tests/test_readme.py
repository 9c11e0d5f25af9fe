"""The README and docs/ say what the code does, and nothing there has gone stale.

- The README's "adding a position encoding" example works as written, and the generic contract tests
  accept it: it registers, decodes incrementally like the full pass, and breaks permutation
  equivariance.
- Every relative link of README.md, docs/*.md and docs/results/README.md names an existing file, and
  every repository path in backticks exists (a ``tests/x.py::name`` names a test of that file).
- Every command of their fenced code blocks that can run here runs (blocks marked bash, sh, shell,
  console or unmarked; ``text`` blocks are output and synopses): ``tpe-train`` (also as ``python -m
  tpe_train.train`` and under ``accelerate launch ... -m tpe_train.train``) in this process with
  ``--print-config``, which loads and validates the preset and overrides without training;
  ``tpe-launch run|submit`` with ``--dry-run``; the other console scripts through their own argument
  parsers, without running; ``python benchmarks/X.py`` and ``python -m benchmarks.gpu.X`` by their
  script and options (the benchmarks' own smoke test runs them).
- Every number in a table of the README's "Results now" section appears in the committed raw output
  linked above that table (under docs/results/; a linked README.md stands for its folder).
- No work-period labels ("session", "sprint") and no "issue N" / "item N" references: a figure is
  labelled by its date, code revision and machine.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from support.models import tiny_model

from tpe_train.positions import base

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "results"
#: The pages these tests read: the README, the top of docs/ and the results index.
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), RESULTS / "README.md"]
#: the study archives' pages, linked from the README as its results (prose, not raw output)
STUDY_PAGES = sorted(RESULTS.glob("multi30k*/README.md"))


def test_readme_position_example_registers_and_decodes_incrementally() -> None:
    text = README.read_text()
    block = re.search(r"## Adding a position encoding.*?```python\n(.*?)```", text, re.S)
    assert block is not None
    namespace = {name: getattr(base, name) for name in dir(base)}
    exec(block.group(1), namespace)
    try:
        assert "linear_bias" in base.POSITIONS
        model = tiny_model("linear_bias")
        src = torch.randint(3, 40, (2, 7))
        tgt = torch.randint(3, 40, (2, 5))
        memory = model.encode(src)
        full = model.decode(tgt, memory)
        cache = model.new_cache()
        steps = [model.decode(tgt[:, i : i + 1], memory, cache) for i in range(5)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
        perm = torch.tensor([3, 1, 2, 0, 4, 5, 6])
        assert not torch.allclose(model.encode(src[:, perm]).states, memory.states[:, perm], atol=1e-4)
        flex = tiny_model("linear_bias", attention="flex")  # its score_mod, against explicit attention
        flex.load_state_dict(model.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(flex.decode(tgt, flex.encode(src)), full, atol=1e-5, rtol=1e-5)
    finally:
        base.POSITIONS._entries.pop("linear_bias", None)


def test_readme_stays_short() -> None:
    assert len(README.read_text().splitlines()) <= 300


# --------------------------------------------------------------------------------------------------
# Markdown: fenced blocks, prose, links, paths

FENCE = re.compile(r"^```(\S*)\s*$")


def blocks(page: Path) -> Iterator[tuple[str, int, list[str]]]:
    """(info string, line number of the first line, lines) of every fenced code block."""
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start, i = i + 1, i + 1
        while i < len(lines) and not lines[i].startswith("```"):
            i += 1
        yield m.group(1), start + 1, lines[start:i]
        i += 1


def prose(page: Path) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append((number, line))
    return out


def where(page: Path, line: int) -> str:
    return f"{page.relative_to(ROOT)}:{line}"


LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def test_relative_links_name_existing_files() -> None:
    broken = []
    for page in PAGES:
        for number, line in prose(page):
            for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
                if re.match(r"[a-z][a-z+.-]*:", target) or target.startswith("#"):
                    continue  # another site, or an anchor of this page (anchors are not checked)
                path = (page.parent / target.split("#")[0]).resolve()
                if not path.is_file():
                    broken.append(f"{where(page, number)}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


#: A path of the repository, maybe with a test name (``tests/x.py::test_y``, or its start and ``...``);
#: ``...`` in the path itself, ``<kind>`` or ``*`` make a placeholder, which is not checked.
REPO_PATH = re.compile(
    r"(?:tpe_train|tests|benchmarks|configs|launcher|slurm|docs)/(?![\w./-]*\.\.\.)[\w./-]*"
    r"(?:::\w+(?:\.\.\.)?)?"
)


def test_repository_paths_in_backticks_exist() -> None:
    missing = []
    for page in PAGES:
        for number, line in prose(page):
            for span in re.findall(r"`([^`]+)`", line):
                for word in span.split():
                    if not REPO_PATH.fullmatch(word):
                        continue  # not a path, or one with placeholders (<kind>, *.json, ...)
                    path, _, test = word.partition("::")
                    if not (ROOT / path).exists():
                        missing.append(f"{where(page, number)}: {path}")
                    elif test and f"def {test.removesuffix('...')}" not in (ROOT / path).read_text():
                        missing.append(f"{where(page, number)}: {word} (no such test)")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


def test_no_command_hides_in_an_indented_code_block() -> None:
    """Commands belong in fenced blocks, where test_documented_command_runs sees them."""
    starts = r"tpe-|python -m (tpe_train|benchmarks)|python benchmarks/|accelerate launch"
    command = re.compile(rf"^ {{4,}}({starts})")
    hidden = [where(page, n) for page in PAGES for n, line in prose(page) if command.match(line)]
    assert not hidden, "indented commands (fence them):\n" + "\n".join(hidden)


LABELS = re.compile(r"\bsessions?\b|\bsprints?\b|\bissues?\s*#?\s*\d+|\bitems?\s+\d+", re.IGNORECASE)


def test_no_work_period_labels_or_issue_references() -> None:
    """In the text, in code blocks and in backticks alike, of every page and every study's page."""
    assert STUDY_PAGES
    found = [
        f"{where(page, number)}: {m.group(0)!r}"
        for page in [*PAGES, *STUDY_PAGES]
        for number, line in enumerate(page.read_text().splitlines(), start=1)
        for m in LABELS.finditer(line)
    ]
    assert not found, "label figures by date, revision and machine instead:\n" + "\n".join(found)


# --------------------------------------------------------------------------------------------------
# Commands of the fenced blocks

RUNNABLE = {"", "bash", "sh", "shell", "console"}
OPERATORS = {"&&", "||", ";", "|"}
ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=")


@dataclass(frozen=True)
class Command:
    page: Path
    line: int
    env: tuple[tuple[str, str], ...]  # the NAME=value words before it
    argv: tuple[str, ...]

    @property
    def id(self) -> str:
        return where(self.page, self.line)


def logical_lines(lines: list[str], first: int) -> Iterator[tuple[int, str]]:
    """Lines with their backslash continuations joined, each with its first line's number."""
    pending, start = "", first
    for number, line in enumerate(lines, start=first):
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""
    if pending:
        yield start, pending


def expand(text: str, variables: dict[str, str]) -> str:
    """$NAME and ${NAME} of the block's own assignments (others are left as written)."""
    return re.sub(r"\$\{?([A-Za-z_]\w*)\}?", lambda m: variables.get(m.group(1), m.group(0)), text)


def segments(words: list[str]) -> Iterator[list[str]]:
    """The simple commands of a line: split at && || ; |, redirections dropped."""
    current: list[str] = []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word in OPERATORS:
            yield current
            current = []
        elif word in {">", ">>", "<", "2>"}:
            skip = True
        else:
            current.append(word)
    yield current


def commands() -> list[Command]:
    found = []
    for page in PAGES:
        for info, first, lines in blocks(page):
            if info not in RUNNABLE:
                continue
            variables: dict[str, str] = {}
            for number, line in logical_lines(lines, first):
                for words in segments(shlex.split(expand(line, variables), comments=True)):
                    env = []
                    while words and ASSIGNMENT.match(words[0]):
                        name, _, value = words.pop(0).partition("=")
                        env.append((name, value))
                    if not words:  # NAME=value alone: a variable of the block
                        variables.update(env)
                    elif checked(words):
                        found.append(Command(page, number, tuple(env), tuple(words)))
    return found


def checked(words: list[str]) -> bool:
    """The project's commands: console scripts, ``accelerate``, ``python -m tpe_train...`` (not the
    config reference's generator), ``python some/script.py``; not pip, pytest or tensorboard."""
    if words[0].startswith(("tpe-", "accelerate")):
        return True
    if words[0] in ("python", "python3") and len(words) > 1:
        module = words[2] if words[1] == "-m" and len(words) > 2 else ""
        return (module.startswith("tpe_train.") and module != "tpe_train.config") or words[1].endswith(".py")
    return False


COMMANDS = commands()


class Parsed(Exception):
    """Raised by the patched ArgumentParser.parse_args: the arguments parsed, nothing run."""

    def __init__(self, namespace: argparse.Namespace) -> None:
        super().__init__()
        self.namespace = namespace


def parse_only(monkeypatch: pytest.MonkeyPatch, main: Any, argv: list[str]) -> argparse.Namespace:
    """Run a console script's ``main`` until its parser has parsed ``argv``."""
    original = argparse.ArgumentParser.parse_args

    def stop(self: argparse.ArgumentParser, *args: Any, **kw: Any) -> argparse.Namespace:
        raise Parsed(original(self, *args, **kw))

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", stop)
        try:
            main(argv)
        except Parsed as parsed:
            return parsed.namespace
    raise AssertionError(f"{argv} was not parsed")


def print_config(argv: list[str]) -> None:
    """``tpe-train ARGV --print-config``, in this process."""
    from tpe_train.train.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*argv, "--print-config"])
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
            for module in (script.parent / f"{name}.py", ROOT / f"{name.replace('.', '/')}.py"):
                if module.is_file():
                    text += module.read_text()
        for word in argv[2:]:
            if word.startswith("--"):
                assert f'"{word.split("=")[0]}"' in text, f"{argv[1]} has no option {word}"


def run_command(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> str:
    """Check one documented command; returns its kind (for the coverage test)."""
    name, args = argv[0], argv[1:]
    if "--config_file" in args:  # accelerate launch, tpe-ckpt reshard: the launch file exists
        launch = args[args.index("--config_file") + 1]
        assert (ROOT / launch).is_file(), f"--config_file {launch} does not exist"
    if name == "accelerate":
        assert args[:1] == ["launch"] and "-m" in args, argv
        module = args[args.index("-m") + 1]
        assert module == "tpe_train.train", f"accelerate launch runs {module}"
        print_config(args[args.index("-m") + 2 :])
        return "accelerate"
    if name.startswith("python"):
        if args[:1] == ["-m"]:
            module, rest = args[1], args[2:]
            if module == "tpe_train.train":
                print_config(rest)
                return "tpe-train"
            if module == "tpe_train.study.cli":
                return run_command(["tpe-study", *rest], monkeypatch)
            if module == "tpe_train.evaluation" and rest[:1] == ["translate"]:
                return run_command(["tpe-translate", *rest[1:]], monkeypatch)
            if module == "tpe_train.evaluation":
                return run_command(["tpe-eval", *rest], monkeypatch)
            if module.startswith("benchmarks.gpu."):  # the GPU checks run as modules
                check_benchmark([name, f"{module.replace('.', '/')}.py", *rest])
                return "script"
            raise AssertionError(f"python -m {module}: a module this test does not know; teach it")
        check_benchmark(argv)
        return "script"
    if name == "tpe-train":
        print_config(args)
    elif name == "tpe-launch":
        from launcher.cli import main

        assert args[:1] in (["run"], ["submit"]), f"tpe-launch {args[:1]} has no dry run"
        for var in [v for v in os.environ if v.startswith("SLURM_")] + ["CUDA_VISIBLE_DEVICES"]:
            monkeypatch.delenv(var, raising=False)
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = main([*args, "--dry-run"])
        assert code == 0, f"tpe-launch {shlex.join(args)} --dry-run: {err.getvalue().strip()}"
    elif name == "tpe-eval":
        from tpe_train.evaluation.cli import eval_args

        eval_args(args)
    elif name == "tpe-translate":
        from tpe_train.evaluation.cli import translate_args

        translate_args(args)
    elif name == "tpe-ckpt":
        from tpe_train.ckpt.cli import main as ckpt_main

        parse_only(monkeypatch, ckpt_main, args)
    elif name == "tpe-data":
        from tpe_train.data.cli import main as data_main

        ns = parse_only(monkeypatch, data_main, args)
        load(ns.preset, ns.overrides)
    elif name == "tpe-study":
        from tpe_train.study.cli import archive_parser, extrapolate_parser, report_parser, run_parser
        from tpe_train.study.grid import parse_seeds, parse_setting

        sub, rest = args[0], args[1:]
        if sub == "run":
            ns = run_parser().parse_intermixed_args(rest)
            for setting in ns.encodings.split(","):
                parse_setting(setting)
            parse_seeds(ns.seeds)
            load(ns.preset, ns.overrides)
        else:
            parsers = {"report": report_parser, "archive": archive_parser, "extrapolate": extrapolate_parser}
            parsers[sub]().parse_args(rest)
    else:
        raise AssertionError(f"{name}: a command this test does not know; teach it")
    return name


@pytest.mark.parametrize("command", COMMANDS, ids=[c.id for c in COMMANDS])
def test_documented_command_runs(command: Command, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the commands are documented from the repository root
    for name, value in command.env:
        monkeypatch.setenv(name, value)
    try:
        run_command(list(command.argv), monkeypatch)
    except SystemExit as stop:  # argparse's error, printed on stderr
        pytest.fail(f"{command.id}: {shlex.join(command.argv)}: exit {stop.code}")


def test_the_command_check_sees_every_kind_of_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """The extraction above is not silently empty: every console script is documented and checked."""
    kinds = {c.argv[0] for c in COMMANDS} | {
        "script" for c in COMMANDS if c.argv[0].startswith("python") and c.argv[1].endswith(".py")
    }
    wanted = {"tpe-train", "tpe-eval", "tpe-translate", "tpe-data", "tpe-ckpt", "tpe-launch", "tpe-study"}
    assert wanted | {"accelerate", "script"} <= kinds, sorted(kinds)
    assert sum(c.argv[0] == "tpe-train" for c in COMMANDS) >= 10


# --------------------------------------------------------------------------------------------------
# The README's figures come from committed raw outputs

NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?")


def normal(number: str) -> str:
    """1,296 -> 1296; 04 -> 4; decimals kept as written (37.40 stays 37.40)."""
    number = number.rstrip(",").replace(",", "")
    return number if "." in number else str(int(number))


def roundings(number: str) -> set[str]:
    """The number and its roundings to fewer decimals (half up and half even)."""
    out = {number}
    if "." in number:
        value = Decimal(number)
        for places in range(len(number.split(".")[1])):
            step = Decimal(1).scaleb(-places)
            for mode in (ROUND_HALF_UP, ROUND_HALF_EVEN):
                out.add(str(value.quantize(step, rounding=mode)))
    return out


@cache
def numbers_of(path: Path) -> frozenset[str]:
    """Every number written in a text file, with its roundings (nothing for plots and events)."""
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        return frozenset()
    return frozenset(r for number in NUMBER.findall(text) for r in roundings(normal(number)))


def raw_numbers(link: Path) -> frozenset[str]:
    """The numbers of a linked raw output; a linked README.md stands for its whole folder."""
    files = [p for p in link.parent.rglob("*") if p.is_file()] if link.name == "README.md" else [link]
    return frozenset().union(*(numbers_of(p) for p in files if p != RESULTS / "README.md"))


def results_tables() -> list[tuple[list[Path], list[tuple[int, str]]]]:
    """Each table of the README's "Results now" section: the files under docs/results/ (its index
    aside) linked since the previous table, and the table's rows with their line numbers."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("## Results now"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    tables: list[tuple[list[Path], list[tuple[int, str]]]] = []
    sources: list[Path] = []
    rows: list[tuple[int, str]] = []
    for number, line in enumerate([*lines[start:end], ""], start=start + 1):
        if line.startswith("|"):
            rows.append((number, line))
            continue
        if rows:
            tables.append((sources, rows))
            sources, rows = [], []
        for target in LINK.findall(line):
            path = (ROOT / target.split("#")[0]).resolve()
            if path.is_file() and path.is_relative_to(RESULTS) and path != RESULTS / "README.md":
                sources.append(path)
    return tables


def test_the_readme_results_are_in_their_committed_raw_outputs() -> None:
    tables = results_tables()
    assert len(tables) >= 4, "the Results now section has lost its tables"
    missing = []
    for sources, rows in tables:
        assert sources, f"README.md:{rows[0][0]}: a results table without a link to its raw output"
        numbers = frozenset().union(*(raw_numbers(s) for s in sources))
        missing += [
            f"README.md:{number}: {figure}"
            for number, row in rows
            for figure in NUMBER.findall(row)
            if normal(figure) not in numbers
        ]
    assert not missing, "figures not in the raw outputs linked above their table:\n" + "\n".join(missing)
