"""The checks that need a GPU, as one script: ``python -m benchmarks.gpu.check OUT_DIR`` on a machine with at
least one CUDA GPU. Not collected by pytest (CI has no GPU); docs/gpu.md records what it printed.
``python -m benchmarks.gpu.check OUT_DIR --dry-run`` (any machine, seconds; the CI smoke test runs it) runs
nothing on a GPU: each check's commands are parsed by their own parsers, their configs loaded and
validated, and ``tpe-launch run`` prints its command (``--dry-run``).

1. the demo, one process on the GPU with bf16 autocast: trained, exported, evaluated on the GPU;
   probe accuracy at least 90%, as on the CPU;
2. ``tpe-launch run`` on this node (DeepSpeed ZeRO-1 over nccl, DeepSpeed's bf16 weights), a
   checkpoint, then the same command with more steps resumes from it;
3. ``tpe-eval --device cuda`` and ``--device cpu`` on the exported demo model agree;
4. the demo's first 300 steps in fp16 on one GPU (torch's dynamic loss scaling without DeepSpeed):
   the loss falls and the logged loss scale stays a positive, finite number.
Each prints PASS/FAIL and its figures; the exit status is the number of failures.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import ROOT, tb_scalars

failures: list[str] = []


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        failures.append(name)


def run(cmd: list[str], log: Path, timeout: int = 600) -> tuple[int, str, float]:
    start = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        code, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        code, text = -1, f"timed out after {timeout} s\n{err.stdout or ''}{err.stderr or ''}"
    log.write_text(text)
    if code != 0:
        print(text[-3000:], flush=True)
    return code, text, time.perf_counter() - start


def tokens_per_s(run_dir: Path) -> float:
    values = sorted(tb_scalars(run_dir, "train/tokens_per_s"))
    return values[len(values) // 2]


DEMO = ["--preset", "demo", "train.bf16=true", "train.progress=false"]  # bf16 autocast


def demo_cmd(py: str, demo: Path) -> list[str]:
    """1: the demo, one process on the GPU."""
    return [py, "-m", "tpe_train.train", *DEMO, f"train.run_dir={demo}"]


def launch_overrides(ds: Path, steps: int) -> list[str]:
    return ["train.save_every=100", "eval.at_end=false", f"train.run_dir={ds}", f"train.max_steps={steps}"]


def launch_cmd(py: str, ds: Path, gpus: str, steps: int) -> list[str]:
    """2: tpe-launch run on this node (DeepSpeed ZeRO-1 over nccl, bf16), ``steps`` steps."""
    return [py, "-m", "launcher.cli", "run", "--nodes", "1", "--gpus-per-node", gpus, "--layout", "gpu_zero1",
            *DEMO, *launch_overrides(ds, steps)]  # fmt: skip


def eval_cmd(py: str, demo: Path, device: str) -> list[str]:
    """3: tpe-eval of the exported demo model on ``device``."""
    return [py, "-m", "tpe_train.evaluation", "--checkpoint", str(demo / "checkpoint"), "--json", "--device",
            device]  # fmt: skip


FP16_STEPS = 300


def fp16_cmd(py: str, run_dir: Path) -> list[str]:
    """4: the demo's first steps in fp16, one process on the GPU."""
    return [py, "-m", "tpe_train.train", "--preset", "demo", "train.fp16=true", "train.progress=false",
            f"train.max_steps={FP16_STEPS}", "eval.at_end=false", f"train.run_dir={run_dir}"]  # fmt: skip


def dry_run(out: Path) -> int:
    """Each check's commands checked without running them: parsed by their own parsers (after
    ``python -m MODULE``), configs loaded and validated, ``tpe-launch run`` with ``--dry-run``."""
    from launcher.cli import main as launch_main
    from tpe_train.evaluation.cli import eval_args
    from tpe_train.train.cli import main as train_main

    def quiet(fn: Any, argv: list[str]) -> tuple[int, str]:
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            return fn(argv), text.getvalue()

    py = sys.executable
    code, text = quiet(train_main, [*demo_cmd(py, out / "demo")[3:], "--print-config"])
    check("dry run: demo", code == 0 and "bf16: true" in text, f"exit {code}, config loads, bf16 on")
    for steps in (200, 300):
        code, text = quiet(launch_main, [*launch_cmd(py, out / "ds", "1", steps)[3:], "--dry-run"])
        loads, _ = quiet(train_main, [*DEMO, *launch_overrides(out / "ds", steps), "--print-config"])
        launch = next((line for line in text.splitlines() if "accelerate" in line), "no accelerate command")
        check(f"dry run: tpe-launch run, {steps} steps", code == 0 and loads == 0, launch[:160])
    for device in ("cuda", "cpu"):
        args = eval_args(eval_cmd(py, out / "demo", device)[3:])
        check(
            f"dry run: tpe-eval --device {device}", args.device == device, f"--checkpoint {args.checkpoint}"
        )
    code, text = quiet(train_main, [*fp16_cmd(py, out / "fp16")[3:], "--print-config"])
    check("dry run: fp16 demo", code == 0 and "fp16: true" in text, f"exit {code}, config loads, fp16 on")
    print(f"{len(failures)} failed: {failures}" if failures else "all passed (dry run: nothing ran on a GPU)")
    return len(failures)


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} GPU(s)")
    py = sys.executable

    # 1. The demo on one GPU, bf16 autocast.
    demo = out / "demo"
    code, text, wall = run(demo_cmd(py, demo), out / "demo.log")
    figures = json.loads((demo / "eval.json").read_text()) if code == 0 else {}
    on_gpu = "on cuda:0" in text
    check(
        "demo on the GPU",
        code == 0 and on_gpu and figures.get("probe_accuracy", 0) >= 0.9,
        f"exit {code}, {wall:.0f} s wall, rank on cuda:0: {on_gpu}, "
        f"BLEU {figures.get('bleu', float('nan')):.1f}, "
        f"probe {figures.get('probe_accuracy', float('nan')):.1%}"
        + (f", median {tokens_per_s(demo):,.0f} target tokens/s" if code == 0 else ""),
    )

    # 2. tpe-launch run on this node: DeepSpeed ZeRO-1 over nccl, bf16; then a resume.
    ds = out / "ds"
    gpus = str(torch.cuda.device_count())
    code, text, wall = run(launch_cmd(py, ds, gpus, 200), out / "ds.log")
    saved = sorted(p.name for p in (ds / "checkpoints").glob("step-*"))
    check(
        "DeepSpeed ZeRO-1 bf16 on the GPU",
        code == 0 and "step-00000200" in saved and "on cuda:0" in text,
        f"exit {code}, {wall:.0f} s, checkpoints {saved}"
        + (f", median {tokens_per_s(ds):,.0f} target tokens/s" if code == 0 else ""),
    )
    code, text, wall = run(launch_cmd(py, ds, gpus, 300), out / "ds_resume.log")
    check(
        "resume on the GPU",
        code == 0 and "resumed from" in text and "at step 200" in text,
        f"exit {code}, {wall:.0f} s, {[line for line in text.splitlines() if 'resumed from' in line]}",
    )

    # 3. tpe-eval on the GPU and on the CPU: the same figures up to float rounding in the search.
    results = {}
    for device in ("cuda", "cpu"):
        code, text, wall = run(eval_cmd(py, demo, device), out / f"eval_{device}.log")
        results[device] = (json.loads(text.strip().splitlines()[-1]) if code == 0 else {}, wall)
    gpu, cpu = results["cuda"][0], results["cpu"][0]
    close = bool(gpu and cpu) and abs(gpu["bleu"] - cpu["bleu"]) < 1.0
    check(
        "tpe-eval --device cuda against cpu",
        close,
        f"BLEU {gpu.get('bleu', float('nan')):.2f} on the GPU ({results['cuda'][1]:.0f} s) against "
        f"{cpu.get('bleu', float('nan')):.2f} on the CPU ({results['cpu'][1]:.0f} s)",
    )

    # 4. fp16 on one GPU without DeepSpeed: torch's loss scaler, the fused AdamW step on CUDA.
    fp16 = out / "fp16"
    code, text, wall = run(fp16_cmd(py, fp16), out / "fp16.log")
    losses = tb_scalars(fp16, "train/loss") if code == 0 else []
    scales = tb_scalars(fp16, "train/loss_scale") if code == 0 else []
    falls = len(losses) > 1 and losses[-1] < 0.7 * losses[0]
    finite = bool(scales) and all(0 < s < float("inf") for s in scales)
    check(
        f"fp16 on the GPU, {FP16_STEPS} steps",
        code == 0 and "on cuda:0" in text and falls and finite,
        f"exit {code}, {wall:.0f} s, loss {losses[0] if losses else float('nan'):.3f} -> "
        f"{losses[-1] if losses else float('nan'):.3f}, loss scale {scales[0] if scales else float('nan'):g}"
        f" -> {scales[-1] if scales else float('nan'):g}",
    )
    print(f"{len(failures)} failed: {failures}" if failures else "all passed")
    return len(failures)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "out", type=Path, nargs="?", default=Path("runs/gpu-check"), help="folder for the logs"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="check the commands on any machine, run nothing"
    )
    args = parser.parse_args()
    sys.exit(dry_run(args.out) if args.dry_run else main(args.out))
