"""Reading the documentation: fenced blocks, prose, and the shell commands they show.

Commands come from two places:

- fenced code blocks marked ``bash``, ``sh``, ``shell``, ``console`` or unmarked (``text`` blocks are
  output and synopses): backslash continuations joined, ``#`` comments dropped, ``$ `` prompts removed
  (in a ``console`` block only the prompted lines are commands), lines split at ``&&``, ``||``, ``;``
  and ``|``, redirections dropped, ``NAME=value`` prefixes kept apart as the command's environment and
  a block's own ``NAME=value`` lines expanded in its later lines;
- inline code spans of the prose that start with a console script and give it an option
  (`` `tpe-translate --length-penalty 0` ``): fragments, checked for their options only.

The project's commands are the console scripts of pyproject.toml, ``accelerate``, ``python -m
tpe_train...``, ``python -m benchmarks...``, ``python some/script.py``, ``sbatch`` and ``bash
some/script``; pip, pytest and the like are not checked.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
#: The pages whose commands are checked: the README, the top of docs/ and the results index.
PAGES = [README, *sorted(DOCS.glob("*.md")), RESULTS / "README.md"]

FENCE = re.compile(r"^```(\S*)\s*$")
RUNNABLE = {"", "bash", "sh", "shell", "console"}
OPERATORS = {"&&", "||", ";", "|"}
REDIRECTIONS = {">", ">>", "<", "2>", "2>>", "&>"}
ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=")
PROMPT = re.compile(r"^\s*\$ ")
INLINE = re.compile(r"`([^`]+)`")


@dataclass(frozen=True)
class Command:
    page: Path
    line: int
    env: tuple[tuple[str, str], ...]  # the NAME=value words before it
    argv: tuple[str, ...]

    @property
    def id(self) -> str:
        return where(self.page, self.line)


def where(page: Path, line: int) -> str:
    return f"{page.relative_to(ROOT)}:{line}"


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
        elif word in REDIRECTIONS:
            skip = True
        else:
            current.append(word)
    yield current


@cache
def console_scripts() -> dict[str, str]:
    """name -> "module:function" of pyproject.toml's [project.scripts]."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return dict(tomllib.load(f)["project"]["scripts"])


def checked(words: list[str]) -> bool:
    """The project's commands (see the module's docstring)."""
    head = words[0]
    if head in console_scripts() or head == "accelerate":
        return True
    if head in ("sbatch", "bash") and len(words) > 1:
        return True
    if head in ("python", "python3") and len(words) > 1:
        module = words[2] if words[1] == "-m" and len(words) > 2 else ""
        project = module.startswith(("tpe_train.", "benchmarks.")) and module != "tpe_train.config"
        return project or words[1].endswith(".py")
    return False


def block_lines(info: str, lines: list[str]) -> list[str]:
    """A block's shell lines: in a ``console`` block only the prompted ones; prompts removed."""
    out: list[str] = []
    for line in lines:
        continued = bool(out) and out[-1].rstrip().endswith("\\")
        if info == "console" and not PROMPT.match(line) and not continued:
            line = ""  # output
        out.append(PROMPT.sub("", line))
    return out


def commands(pages: list[Path] = PAGES) -> list[Command]:
    """Every project command of the pages' runnable fenced blocks."""
    found = []
    for page in pages:
        for info, first, lines in blocks(page):
            if info not in RUNNABLE:
                continue
            variables: dict[str, str] = {}
            for number, line in logical_lines(block_lines(info, lines), first):
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


def inline_commands(pages: list[Path] = PAGES) -> list[Command]:
    """Code spans of the prose that start with a console script and give it at least one option."""
    found = []
    for page in pages:
        for number, line in prose(page):
            for span in INLINE.findall(line):
                try:
                    words = shlex.split(span)
                except ValueError:
                    continue
                if words and words[0] in console_scripts() and any(w.startswith("--") for w in words):
                    found.append(Command(page, number, (), tuple(words)))
    return found
