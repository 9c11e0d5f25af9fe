"""The GPU checks judge their goals from the benchmarks' JSON (``benchmarks/gpu/scale.py``,
``benchmarks/gpu/attention.py``): figures on each side of every threshold, a missing row, and a part
cut at its time limit that keeps what it printed before. The CPU smoke run of both scripts is in
``test_benchmarks.py``; this checks the verdicts, which a dry run's CPU figures cannot."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gpu_scale() -> ModuleType:
    """``benchmarks.gpu.scale`` as ``python -m`` imports it from the repository root."""
    sys.path.insert(0, str(ROOT))
    try:
        import benchmarks.gpu.scale as module
    finally:
        sys.path.remove(str(ROOT))
    return module


def _memory(layers_chunks: float) -> dict[str, Any]:
    rows = [("none/whole", 1.0), ("none/chunks of 1024", 1.3), ("layers/whole", 2.2)]
    rows.append(("layers/chunks of 1024", layers_chunks))
    return {"rows": [{"row": r, "peak_ratio": v} for r, v in rows]}


@pytest.mark.parametrize(("ratio", "met"), [(2.6, True), (2.5, True), (2.4, False)])
def test_memory_goal_is_layers_with_chunks_at_least_2_5x_lower(
    gpu_scale: ModuleType, ratio: float, met: bool
) -> None:
    checks = gpu_scale.memory_goals(_memory(ratio))
    assert [ok for ok, _ in checks] == [None, met]  # layers/whole is reported, without a goal
    assert f"{ratio:.2f}x lower" in checks[1][1] and "layers/chunks of 1024" in checks[1][1]


def test_memory_goal_fails_without_a_chunked_layers_row(gpu_scale: ModuleType) -> None:
    figures = _memory(3.0)
    figures["rows"] = figures["rows"][:-1]
    assert [ok for ok, _ in gpu_scale.memory_goals(figures)] == [None, False]


@pytest.mark.parametrize(("zero1", "met"), [(1.08, True), (1.10, True), (1.25, False)])
def test_engine_goal_is_zero1_within_1_10x_plain(gpu_scale: ModuleType, zero1: float, met: bool) -> None:
    rows = [{"row": "plain", "vs_plain": 1.0}, {"row": "ZeRO-1", "vs_plain": zero1}]
    rows.append({"row": "ZeRO-2", "vs_plain": 1.4})
    checks = gpu_scale.engine_goals({"rows": rows})
    assert [ok for ok, _ in checks] == [met, None]
    assert f"ZeRO-1 {zero1:.2f}x plain" in checks[0][1]
    assert gpu_scale.engine_goals({"rows": rows[:1]}) == [(False, "engine: no ZeRO-1 row")]


def _train_row(row: str, step_ms: float, mfu: float, group: str = "sinusoidal") -> dict[str, Any]:
    kind, backend = row.split("/")
    compiled = backend.endswith("compiled")
    backend = backend.removesuffix(" compiled")
    return {"row": row, "group": group, "kind": kind, "backend": backend, "compiled": compiled,
            "step_ms": step_ms, "mfu": mfu}  # fmt: skip


def test_attention_goals_judge_each_row_against_its_twin_and_each_peer(gpu_scale: ModuleType) -> None:
    bench = {
        "train": [
            _train_row("none/sdpa", 100.0, 0.30),
            _train_row("sinusoidal/sdpa", 105.0, 0.29),
            _train_row("none/sdpa compiled", 70.0, 0.43),
            _train_row("sinusoidal/sdpa compiled", 90.0, 0.34),
        ],
        "hf": [
            {"row": "sinusoidal/auto", "vs_hf": 1.35},
            {"row": "hf-marian/sdpa", "vs_hf": 1.0},
            {"row": "learned/auto", "vs_hf": 1.2},
            {"row": "hf-bart/sdpa", "vs_hf": 1.0},
        ],
    }
    verdicts = {text.split(" (goal")[0]: ok for ok, text in gpu_scale.attention_goals(bench)}
    assert verdicts == {
        "sinusoidal: best step sinusoidal/sdpa / best none = 1.05x": True,
        "none/sdpa compiled: compiled 1.43x faster than eager": True,
        "sinusoidal/sdpa compiled: compiled 1.17x faster than eager": False,
        "best MFU 43.0% (none/sdpa compiled) of the matmul peak measured in the run": True,
        "sinusoidal/auto: 1.35x the speed of hf-marian/sdpa": True,
        "learned/auto: 1.20x the speed of hf-bart/sdpa": False,
    }


def test_a_part_cut_at_its_limit_keeps_what_it_printed(gpu_scale: ModuleType, tmp_path: Path) -> None:
    log = gpu_scale.Log(tmp_path / "log.txt")
    printing = "import time; print('figure 1', flush=True); time.sleep(30); print('figure 2')"
    assert gpu_scale.run_part([sys.executable, "-c", printing], 3.0, log) == -1
    text = (tmp_path / "log.txt").read_text()
    assert "figure 1" in text and "figure 2" not in text and "stopped after its limit of 3 s" in text
    failing = "print('a'); print('b'); raise SystemExit(3)"
    assert gpu_scale.run_part([sys.executable, "-c", failing], 30.0, log) == 3
    assert (tmp_path / "log.txt").read_text().endswith("a\nb\n")
