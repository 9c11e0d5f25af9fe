"""The README and docs/ say what the code does, and nothing there has gone stale.

- The README's "adding a position encoding" example works as written, and the generic contract tests
  accept it: it registers, decodes incrementally like the full pass, and breaks permutation
  equivariance.
- Every relative link of README.md, docs/*.md and docs/results/README.md names an existing file, and
  every repository path in backticks exists (a ``tests/x.py::name`` names a test of that file).
- The commands of their code blocks: tests/test_doc_commands.py.
- Every number in a table of the README's "Results now" section appears in the committed raw output
  linked above that table (under docs/results/; a linked README.md stands for its folder).
- No work-period labels ("session", "sprint") and no "issue N" / "item N" references: a figure is
  labelled by its date, code revision and machine.
"""

from __future__ import annotations

import re
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from functools import cache
from pathlib import Path

import torch
from support.docs import PAGES, README, RESULTS, ROOT, prose, where
from support.models import tiny_model

from tpe_train.positions import base

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
