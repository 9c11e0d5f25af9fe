"""The checks that need a GPU, as one script: ``python benchmarks/gpu_check.py OUT_DIR`` on a machine with at
least one CUDA GPU. Not collected by pytest (CI has no GPU); docs/gpu.md records what it printed.

1. the demo, one process on the GPU with bf16 autocast: trained, exported, evaluated on the GPU;
   probe accuracy at least 90%, as on the CPU;
2. ``tpe-launch run`` on this node (DeepSpeed ZeRO-1 over nccl, DeepSpeed's bf16 weights), a
   checkpoint, then the same command with more steps resumes from it;
3. ``tpe-eval --device cuda`` and ``--device cpu`` on the exported demo model agree.
Each prints PASS/FAIL and its figures; the exit status is the number of failures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
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
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    values = sorted(e.value for e in acc.Scalars("train/tokens_per_s"))
    return values[len(values) // 2]


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} GPU(s)")
    py = sys.executable

    # 1. The demo on one GPU, bf16 autocast.
    demo = out / "demo"
    code, text, wall = run([py, "-m", "tpe_train.train", "--preset", "demo", "train.bf16=true",
                            "train.progress=false", f"train.run_dir={demo}"], out / "demo.log")  # fmt: skip
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
    base = [py, "-m", "launcher.cli", "run", "--nodes", "1", "--gpus-per-node", gpus, "--preset", "demo",
            "train.bf16=true", "train.progress=false", "train.save_every=100", "eval.at_end=false",
            f"train.run_dir={ds}"]  # fmt: skip
    code, text, wall = run([*base, "train.max_steps=200"], out / "ds.log")
    saved = sorted(p.name for p in (ds / "checkpoints").glob("step-*"))
    check(
        "DeepSpeed ZeRO-1 bf16 on the GPU",
        code == 0 and "step-00000200" in saved and "on cuda:0" in text,
        f"exit {code}, {wall:.0f} s, checkpoints {saved}"
        + (f", median {tokens_per_s(ds):,.0f} target tokens/s" if code == 0 else ""),
    )
    code, text, wall = run([*base, "train.max_steps=300"], out / "ds_resume.log")
    check(
        "resume on the GPU",
        code == 0 and "resumed from" in text and "at step 200" in text,
        f"exit {code}, {wall:.0f} s, {[line for line in text.splitlines() if 'resumed from' in line]}",
    )

    # 3. tpe-eval on the GPU and on the CPU: the same figures up to float rounding in the search.
    results = {}
    for device in ("cuda", "cpu"):
        code, text, wall = run([py, "-m", "tpe_train.evaluation", "--checkpoint", str(demo / "checkpoint"),
                                "--json", "--device", device], out / f"eval_{device}.log")  # fmt: skip
        results[device] = (json.loads(text.strip().splitlines()[-1]) if code == 0 else {}, wall)
    gpu, cpu = results["cuda"][0], results["cpu"][0]
    close = bool(gpu and cpu) and abs(gpu["bleu"] - cpu["bleu"]) < 1.0
    check(
        "tpe-eval --device cuda against cpu",
        close,
        f"BLEU {gpu.get('bleu', float('nan')):.2f} on the GPU ({results['cuda'][1]:.0f} s) against "
        f"{cpu.get('bleu', float('nan')):.2f} on the CPU ({results['cpu'][1]:.0f} s)",
    )
    print(f"{len(failures)} failed: {failures}" if failures else "all passed")
    return len(failures)


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("runs/gpu-check")))
