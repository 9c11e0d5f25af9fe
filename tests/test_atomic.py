"""tpe_train/run/atomic.py: whole files or none, temporaries unique and recognisable."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tpe_train.run import atomic


def test_write_replaces_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "batch.json"
    target.write_text("old")
    atomic.write_json(target, {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["batch.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "config.yaml"
    target.write_text("old")

    def broken(src: object, dst: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        atomic.write_text(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


def test_temporary_names_are_unique_and_recognised(tmp_path: Path) -> None:
    names = {atomic.temp_name(tmp_path / "x") for _ in range(100)}
    assert len(names) == 100
    assert all(atomic.is_temp(n) and n.parent == tmp_path for n in names)
    assert not atomic.is_temp(tmp_path / ".x.tmp-123")  # another program's temporary is not ours
