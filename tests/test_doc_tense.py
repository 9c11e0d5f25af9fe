"""The README and docs/ say what the product does now: the product's history stays in commit
messages and in the raw outputs under docs/results/."""

from __future__ import annotations

import re

from support.docs import DOCS, README, prose, where

PAGES = [README, *sorted(DOCS.glob("*.md"))]
HISTORY = re.compile(
    r"\b(before this (change|design)|used to|since then|previously|formerly|no longer|was changed|we fixed"
    r"|(was|has been) fixed"
    r"|not (yet|\w+ \w+ yet|been \w+ yet)|(not|never) \w+ yet|has not \w+ on a \w+ yet)\b",
    re.I,
)


def test_no_history_phrases_in_the_docs() -> None:
    found = [
        f"{where(page, number)}: {m.group(0)!r}"
        for page in PAGES
        for number, line in prose(page)
        for m in HISTORY.finditer(line)
    ]
    assert not found, "say what holds now (history goes to commit messages):\n" + "\n".join(found)
