"""Every script in benchmarks/ runs in its small mode (``--smoke``; the GPU checks of benchmarks/gpu/
their ``--dry-run``) and prints or writes its figures, so that a config or package change cannot
silently break a benchmark's documented command. The scripts are found by glob: a new one fails here
until it has a small mode and an entry in SMOKE. Each runs as its documented command does (``python
benchmarks/X.py``; ``python -m benchmarks.gpu.X``), one thread where it takes ``--threads``, with its
checks on the JSON it writes or the table it prints."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
LIBRARIES = {"harness.py", "peers.py"}  # imported by the scripts, not run
GPU_CHECKS = sorted(f"gpu/{p.name}" for p in (BENCHMARKS / "gpu").glob("*.py") if p.name != "__init__.py")
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if p.name not in LIBRARIES) + GPU_CHECKS
KINDS = ["none", "sinusoidal", "learned", "shaw", "t5", "alibi", "rope"]


def check_train(out: Path, stdout: str) -> None:
    figures = json.loads(out.read_text())
    rows = {(r["model"], r["dtype"]) for r in figures["train"]}
    models = [*KINDS, "hf-marian", "hf-bart", "hf-t5"]
    assert rows == {(m, dt) for m in models for dt in ("fp32", "bf16")}
    assert all(r["step_ms"] > 0 and r["mfu"] > 0 and math.isfinite(r["last_loss"]) for r in figures["train"])
    assert {r["model"] for r in figures["decode"]} == set(models)
    assert all(r["decoded_steps_per_sentence"] == 4 for r in figures["decode"])  # N = 3, then EOS
    assert set(figures["peak_during_training"]) == {"fp32", "bf16"} and figures["kernel_table"]
    assert "beam search: beam 4" in stdout


def check_profile(out: Path, stdout: str) -> None:
    assert "ms in ATen ops, of which GEMMs" in stdout
    assert "GEMM peak measured now" in stdout and "a step of only its GEMMs" in stdout


def check_attention(out: Path, stdout: str) -> None:
    figures = json.loads(out.read_text())
    assert [r["row"] for r in figures["train"]] == [
        "none/sdpa",
        "none/explicit",
        "rope/sdpa",
        "rope/explicit",
    ]
    assert all(r["memory_bytes"] > 0 and r["vs_none"] > 0 for r in figures["train"])
    assert [r["row"].split("/")[0] for r in figures["hf"]] == [
        "sinusoidal", "hf-marian", "learned", "hf-bart", "t5", "hf-t5"
    ]  # fmt: skip
    assert [r["row"] for r in figures["decode"]] == ["t5/sdpa", "t5/explicit"]
    assert all(r["same_hypotheses"] for r in figures["decode"])


def check_translate(out: Path, stdout: str) -> None:
    figures = json.loads(out.read_text())
    assert figures["same_lengths"] is True and figures["lines"] == 24
    assert [r["name"] for r in figures["rows"]] == ["tpe-translate", "hf-generate"]
    assert figures["ratio"] > 0 and "tpe-translate / HF generate" in stdout


def check_data(out: Path, stdout: str) -> None:
    figures = json.loads(out.read_text())
    assert [r["corpus"] for r in figures["prepare"]] == ["newstest", "multi30k"]
    assert all(r["pairs"] > 0 and r["tpe_pairs_per_s"] > 0 for r in figures["prepare"])
    assert figures["iterator_ms"] > 0 and figures["base_step_ms"] > 0


def check_wmt_scale(out: Path, stdout: str) -> None:
    figures = json.loads(out.read_text())
    assert figures["pairs"] == 2000
    assert [r["num_proc"] for r in figures["prepare"]] == [1] and figures["prepare"][0]["kept_pairs"] > 0
    assert figures["iterator"]["ms_per_batch"] > 0 and figures["iterator"]["base_step_ms"] > 0
    assert "goals: peak memory <= 3 GB" in stdout


def check_prepare(out: Path, stdout: str) -> None:
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tree"], r["pairs"]) for r in rows] == [("this tree", 3000)]
    assert rows[0]["pairs_per_s"] > 0 and 0 < rows[0]["peak_anon_gib"] <= rows[0]["peak_pss_gib"]
    assert "duplicate" in rows[0]["summary"][0] and rows[0]["summary"][1].startswith("built ")
    assert "anon GiB" in stdout


def check_checkpoint(out: Path, stdout: str) -> None:
    figures = json.loads(out.read_text())["zero3x2"]
    assert (figures["world_size"], figures["zero_stage"], len(figures["ranks"])) == (2, 3, 2)
    assert all(figures["bytes"][k] > 0 for k in ("sharded", "async", "gathering"))
    assert "bytes written / (weights + moments)" in stdout


def check_parallel(out: Path, stdout: str) -> None:
    figures = json.loads(out.read_text())
    assert list(figures["rows"]) == ["1 process", "TP=2"]
    assert figures["figures"]["tp2_over_tp1_step_time"] > 0
    assert 0 < figures["figures"]["tp2_position_bytes_ratio_t5"] < 1  # TP=2 splits T5's table by heads


def check_gpu_attention(out: Path, stdout: str) -> None:
    grads = json.loads((out / "grads.json").read_text())
    assert len(grads) == len(KINDS) + 1 and all(g["worst_relative"] <= 1e-5 for g in grads.values())
    bench = json.loads((out / "bench.json").read_text())
    assert {r["group"] for r in bench["train"]} == {"t5", "rope"} and bench["hf"] and bench["decode"]
    assert "dry run" in (out / "summary.txt").read_text()


def check_gpu_check(out: Path, stdout: str) -> None:
    assert stdout.count("PASS dry run") == 6 and "all passed" in stdout


def check_gpu_scale(out: Path, stdout: str) -> None:
    assert sorted(p.name for p in out.iterdir()) == [
        "batch.json", "engine.json", "log.txt", "memory.json", "summary.txt"
    ]  # fmt: skip
    summary = (out / "summary.txt").read_text()
    assert "NOT MEASURED" not in summary and "dry run" in summary
    for goal in ("layers/chunks of 16 peak", "ZeRO-1", "ZeRO-2", "best MFU", "the speed of hf-marian"):
        assert goal in summary, goal
    assert "against Hugging Face" in (out / "log.txt").read_text()  # part 3's table, teed


def check_export(out: Path, stdout: str) -> None:
    figures = json.loads(out.read_text())
    assert [r["name"] for r in figures["rows"]] == ["tpe-translate", "hf-generate", "ct2-float32", "ct2-int8"]
    assert figures["lines"] == 20 and all(r["sentences_per_s"] > 0 for r in figures["rows"])
    assert "| engine | s/pass | sentences/s |" in stdout


def check_memory(out: Path, stdout: str) -> None:
    rows = json.loads(out.read_text())["rows"]
    modes = ("none", "layers", "every_n")
    assert [r["row"] for r in rows] == [f"{m}/{c}" for m in modes for c in ("whole", "chunks of 16")]
    assert all(r["peak_mib"] > 0 and r["step_ms"] > 0 for r in rows)
    assert rows[0]["peak_ratio"] == rows[0]["time_ratio"] == 1.0
    assert "peak above weights" in stdout


def check_engine(out: Path, stdout: str) -> None:
    rows = json.loads(out.read_text())["rows"]
    assert [r["row"] for r in rows] == ["plain", "ZeRO-0", "ZeRO-1", "ZeRO-2"]
    assert all(r["median_ms"] > 0 for r in rows) and rows[0]["vs_plain"] == 1.0
    packages = [r["host_ms_by_package"] for r in rows]
    assert packages[0]["deepspeed"] == 0 < packages[0]["tpe_train"]
    assert all(p["deepspeed"] > 0 and p["tpe_train"] > 0 for p in packages[1:])
    assert "own host time per step" in stdout


Check = Callable[[Path, str], None]
#: script -> (its small mode's arguments, OUT standing for a fresh path; the check of what it wrote)
SMOKE: dict[str, tuple[list[str], Check]] = {
    "bench_train.py": (["--smoke", "--threads", "1", "--json", "OUT"], check_train),
    "profile_step.py": (["--smoke", "--threads", "1", "--timer", "ops"], check_profile),
    "bench_attention.py": (["--smoke", "--threads", "1", "--json", "OUT"], check_attention),
    "bench_translate.py": (["--smoke", "--threads", "1", "--json", "OUT"], check_translate),
    "bench_data.py": (["--smoke", "--threads", "1", "--json", "OUT"], check_data),
    "bench_wmt_scale.py": (["--smoke", "--json", "OUT"], check_wmt_scale),
    "bench_prepare.py": (["--smoke", "--json", "OUT"], check_prepare),
    "bench_checkpoint.py": (["--smoke", "--json", "OUT"], check_checkpoint),
    "bench_parallel.py": (["--smoke", "--json", "OUT"], check_parallel),
    "bench_memory.py": (["--smoke", "--threads", "1", "--json", "OUT"], check_memory),
    "bench_engine.py": (["--smoke", "--threads", "1", "--json", "OUT"], check_engine),
    "gpu/attention.py": (["OUT", "--dry-run"], check_gpu_attention),
    "gpu/check.py": (["OUT", "--dry-run"], check_gpu_check),
    "gpu/scale.py": (["OUT", "--dry-run"], check_gpu_scale),
    "bench_export.py": (["--smoke", "--threads", "1", "--json", "OUT"], check_export),
}


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_runs_in_its_small_mode(script: str, tmp_path: Path) -> None:
    assert script in SMOKE, f"benchmarks/{script} has no small mode here: give it one and add it to SMOKE"
    args, check = SMOKE[script]
    out = tmp_path / "out"
    how = ["-m", f"benchmarks.{script[:-3].replace('/', '.')}"] if "/" in script else [f"benchmarks/{script}"]
    cmd = [sys.executable, *how, *(str(out) if a == "OUT" else a for a in args)]
    # one OpenMP thread where a script does not set its own: on a busy 2-core machine two spin-waiting
    # threads per process made steps of tiny models take a second instead of milliseconds
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    check(out, proc.stdout)


def test_every_benchmark_has_an_entry() -> None:
    assert set(SMOKE) == set(SCRIPTS), "SMOKE names a script that is gone, or misses one"
