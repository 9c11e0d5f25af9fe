"""run/members.py on its own: which names pass, which files open, how JSON is checked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tpe_train.run import members

REFUSED = {
    "/etc/passwd": "is absolute",
    "\\\\server\\share": "is absolute",
    "..": "points outside its folder",
    "../x": "points outside its folder",
    ".": "holds an empty or '.' part",
    "": "is empty or too long",
    "x" * 256: "is empty or too long",
    "a\0b": "holds a NUL character",
    "a/b": "holds a path separator",
    "a\\b": "holds a path separator",
    5: "is of type int, not a string",
    None: "is of type NoneType, not a string",
}


@pytest.mark.parametrize(("name", "said"), list(REFUSED.items()))
def test_only_plain_names_pass(tmp_path: Path, name: object, said: str) -> None:
    with pytest.raises(members.MemberError, match=f"names the file .*, which {said}"):
        members.check_name(name, tmp_path / "index.json")


def test_nested_names_pass_only_with_plain_parts(tmp_path: Path) -> None:
    assert members.check_name("deepspeed/mp_rank_00.pt", tmp_path, nested=True) == "deepspeed/mp_rank_00.pt"
    for bad in ("deepspeed/../../x", "deepspeed//x", "deepspeed/./x", "/deepspeed/x"):
        with pytest.raises(members.MemberError):
            members.check_name(bad, tmp_path, nested=True)
    with pytest.raises(members.MemberError, match="is not listed"):
        members.check_name("b.json", tmp_path, listed={"a.json": {}})


def test_a_symlinked_folder_on_the_way_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "f").write_text("x")
    (tmp_path / "deepspeed").symlink_to(tmp_path / "real")
    with pytest.raises(members.MemberError, match="is a symlink, where a folder"):
        members.sha256(tmp_path, "deepspeed/f", nested=True)


def test_json_types_are_strict(tmp_path: Path) -> None:
    (tmp_path / "t.json").write_text('{"step": true, "n": 1.5, "tags": {}}')
    with pytest.raises(members.MemberError, match="'step' is true, where an int is expected"):
        members.read_json(tmp_path, "t.json", {"step": int})
    with pytest.raises(members.MemberError, match="'missing' is null, where a str is expected"):
        members.read_json(tmp_path, "t.json", {"missing": str})
    assert members.read_json(tmp_path, "t.json", {"n": (int, float), "tags": dict})["n"] == 1.5
    (tmp_path / "bad.json").write_bytes(b"\xff{}")
    with pytest.raises(members.MemberError, match="is not UTF-8 text"):
        members.read_json(tmp_path, "bad.json")


def test_a_fifo_and_an_oversized_file_are_refused_without_reading(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "f.json")
    with pytest.raises(members.MemberError, match=r"is not a regular file \(a fifo\)"):
        members.read_json(tmp_path, "f.json")
    with open(tmp_path / "big.json", "wb") as f:
        f.truncate(3 * members.MIB)
    with pytest.raises(members.MemberError, match="is 3 MiB, more than the 1 MiB"):
        members.read_json(tmp_path, "big.json", limit=members.MIB)
