"""Preparation is one straight pipeline (tpe_train/data/prepare.py): no stage module imports another
stage or the config, and a real preparation of a text corpus enters the stages once each, in order,
without passing the config to any of them.

The stages and their modules are ``STAGES``; the other modules of tpe_train/data/ are the
orchestrator (prepare.py), the config's translation into plain specs (specs.py), and helpers that
stages may share (errors.py, lengths.py, tokenizer.py).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import os
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from tpe_train.config import load_config
from tpe_train.data import prepare as prepare_module
from tpe_train.data import tokenise
from tpe_train.data.dedup import first_of_each
from tpe_train.data.splits import pairs_dataset

ROOT = Path(__file__).resolve().parent.parent
STAGES = {  # stage -> its modules (tpe_train/data/<name>.py), in pipeline order
    "read": ("sources", "textfiles"),
    "clean": ("clean",),
    "dedup": ("dedup",),
    "tokenise": ("tokenise",),
    "store": ("store",),
}
ORDER = list(STAGES)


def _path(module: str) -> Path:
    parts = module.split(".")
    file = ROOT.joinpath(*parts).with_suffix(".py")
    return file if file.is_file() else ROOT.joinpath(*parts, "__init__.py")


def _direct_imports(module: str) -> set[str]:
    """The tpe_train modules and packages ``module`` imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(_path(module).read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return {m for m in found if m.split(".")[0] == "tpe_train" and _path(m).is_file()}


def _reachable(module: str) -> set[str]:
    """Every tpe_train module importing ``module`` loads, its packages' ``__init__`` included."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        for m in [*_direct_imports(name), *parents]:
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen - {module}


def test_no_stage_imports_another_stage_or_the_config() -> None:
    modules = {f"tpe_train.data.{m}": stage for stage, names in STAGES.items() for m in names}
    assert all(_path(m).is_file() for m in modules), "a stage module was renamed: update STAGES"
    assert "tpe_train.data.textfiles" in _reachable("tpe_train.data.sources")  # the check sees imports
    for module, stage in modules.items():
        reached = _reachable(module)
        config = sorted(m for m in reached if m.startswith("tpe_train.config"))
        assert not config, f"{module} (stage {stage}) imports {config}: stages take plain specs"
        others = sorted(m for m in reached if modules.get(m, stage) != stage)
        assert not others, f"{module} (stage {stage}) imports other stages: {others}"


def _is_config(value: Any) -> bool:
    return type(value).__module__.startswith("tpe_train.config")


def _holds_config(value: Any) -> bool:
    """``value`` is a config object, or holds one as a field or among its first items."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        inner = [getattr(value, f.name) for f in dataclasses.fields(value)]
    elif isinstance(value, list | tuple | set | frozenset):
        inner = list(value)[:50]
    elif isinstance(value, dict):
        inner = list(value.values())[:50]
    else:
        inner = []
    return _is_config(value) or any(_is_config(v) for v in inner)


class StageTrace:
    """A profile hook that records the stages entered (a new entry when the stage changes) and every
    stage function that finds a config object among its arguments or closure."""

    def __init__(self) -> None:
        self.files = {
            os.path.realpath(importlib.import_module(f"tpe_train.data.{m}").__file__ or ""): stage
            for stage, names in STAGES.items()
            for m in names
        }
        self.stage_of: dict[str, str | None] = {}
        self.entered: list[tuple[str, str]] = []  # (stage, first function entered)
        self.config_in: list[str] = []

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        name = frame.f_code.co_filename
        if name not in self.stage_of:
            self.stage_of[name] = self.files.get(os.path.realpath(name))
        stage = self.stage_of[name]
        if stage is None:
            return
        if not self.entered or self.entered[-1][0] != stage:
            self.entered.append((stage, frame.f_code.co_name))
        if any(_holds_config(v) for v in frame.f_locals.values()):
            self.config_in.append(f"{stage}: {frame.f_code.co_name}")

    def stages(self) -> list[str]:
        return [stage for stage, _ in self.entered]


def traced(call: Any, *args: Any) -> StageTrace:
    trace = StageTrace()
    sys.setprofile(trace)
    try:
        call(*args)
    finally:
        sys.setprofile(None)
    return trace


def _data_cfg(tmp_path: Path):  # type: ignore[no-untyped-def]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    train = [(f"das haus {i % 40} ist klein", f"the house {i % 40} is small") for i in range(200)]
    train += [("", "leer"), ("ein  haus", "a  house")]  # dropped by cleaning; rewritten by it
    for split, pairs in {"train": train, "validation": train[:5], "test": train[5:9]}.items():
        (corpus / f"{split}.de").write_text("".join(s + "\n" for s, _ in pairs))
        (corpus / f"{split}.en").write_text("".join(t + "\n" for _, t in pairs))
    overrides = [
        "data.corpus=text", f"data.path={corpus}", "data.src_lang=de", "data.tgt_lang=en",
        f"data.store_dir={tmp_path / 'store'}", f"data.cache_dir={tmp_path / 'hf'}", "data.vocab_size=60",
        "data.clean.dedup=true",
    ]  # fmt: skip
    return load_config("demo", overrides).data


def test_prepare_enters_each_stage_once_in_order_and_no_stage_sees_the_config(tmp_path: Path) -> None:
    cfg = _data_cfg(tmp_path)
    trace = traced(prepare_module.prepare, cfg)
    assert trace.stages() == ORDER, f"stages entered (stage, first function): {trace.entered}"
    assert trace.config_in == [], f"stage functions given the config: {trace.config_in}"
    data = prepare_module.prepare(cfg)  # reused: the traced preparation built the store
    assert not data.built
    assert data.splits.report == ["train: 41 of 202 pairs kept (dropped: empty 1, duplicate 160)"]


def test_the_trace_sees_a_back_call_and_a_config_given_to_a_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checks above can fail: a de-duplication called again after tokenising, and a stage function
    called with the config, are both caught."""
    cfg = _data_cfg(tmp_path)
    drop_too_long = prepare_module.drop_too_long

    def back_call(train: Any, max_len: int) -> Any:
        first_of_each(pairs_dataset([("a", "b"), ("a", "b")]))  # dedup again, after tokenise
        return drop_too_long(train, max_len)

    monkeypatch.setattr(prepare_module, "drop_too_long", back_call)
    assert traced(prepare_module.prepare, cfg).stages() == [*ORDER[:4], "dedup", "tokenise", "store"]

    def given_config() -> None:
        with pytest.raises(TypeError):
            tokenise.sample(cfg, 1)  # type: ignore[arg-type]

    assert traced(given_config).config_in == ["tokenise: sample"]
