"""The GPU checks of issue 13 in one script (about 8 minutes on one H200); CI has no GPU.

    python benchmarks/gpu_attention.py OUT_DIR              # on a machine with a CUDA GPU
    python benchmarks/gpu_attention.py OUT_DIR --dry-run    # the same checks on the CPU, tiny shapes,
                                                            # seconds (the CI smoke test runs it)

1. Gradients (fp32, TF32 off): for every encoding (Shaw with and without relative values), a tiny
   encoder-decoder with padding runs forward + loss + backward through the fused, compiled ``flex``
   kernel and through ``explicit``; the gradients of the inputs (the scaled source and target
   embeddings) and of every parameter, position tables included, must agree within 1e-5 (relative
   to the largest gradient of that tensor). Dry run: flex cannot run a backward on the CPU, so there
   ``sdpa`` stands in for it (the code path is the same, the claim is not).
2. ``bench_attention.py`` at wmt14_en_de_big in bf16 on the GPU: every encoding against ``none`` with
   each backend, eager, and compiled for none/t5/rope; the same shape against MarianMT, BART and T5;
   beam search flex against sdpa. Dry run: its small mode (``--smoke``: a tiny model on the CPU, fp32,
   generated text) for t5 and rope and the HF peers, without compiled rows and flex (both
   compile, which takes minutes on a CPU), beam search explicit against sdpa.
3. A summary of the issue's GPU goals, each PASS or FAIL with its figure: every encoding within
   1.10x of none (best backend per encoding, eager), peak step memory of t5/alibi/shaw with flex at
   most 0.6x of sdpa's dense-mask path, the compiled step at least 1.3x faster than eager, MFU at
   least 40% of the bf16 matmul peak measured in the same run.

Everything it prints is also written to OUT_DIR (grads.json, bench.json, bench.txt, summary.txt);
commit OUT_DIR under docs/results/gpu/. The exit status is the number of failed checks.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from harness import ROOT, build

from tpe_train.config import load_config
from tpe_train.model.loss import label_smoothed_loss
from tpe_train.model.transformer import Transformer
from tpe_train.positions import POSITIONS

VARIANTS = [*POSITIONS.names(), "shaw+values"]


def tiny(variant: str, backend: str, device: torch.device) -> Transformer:
    kind = "shaw" if variant == "shaw+values" else variant
    cfg = load_config(None, [
        "model.d_model=64", "model.n_heads=4", "model.ffn_dim=128", "model.encoder_layers=2",
        "model.decoder_layers=2", "model.dropout=0", f"model.attention={backend}",
        f"model.position.kind={kind}", "model.position.max_positions=64", "model.position.shaw_clip=4",
        "model.position.t5_buckets=8", "model.position.t5_max_distance=16",
        f"model.position.shaw_values={variant == 'shaw+values'}", "data.vocab_size=50", "data.max_len=60",
    ])  # fmt: skip
    model = build(cfg, device=device, seed=0)
    for module in model.modules():
        if getattr(module, "values", None) is not None:
            torch.nn.init.normal_(module.values)  # zero at init: make the value term count
    return model


def gradients(model: Transformer, device: torch.device) -> dict[str, torch.Tensor]:
    """Gradients of every parameter and of the two scaled embeddings (the stacks' inputs)."""
    g = torch.Generator().manual_seed(1)
    src = torch.randint(3, 50, (4, 11), generator=g)
    src[1, 7:], src[3, 4:] = 0, 0  # padding
    tgt_out = torch.randint(3, 50, (4, 9), generator=g)
    tgt_in = torch.cat([torch.ones(4, 1, dtype=torch.long), tgt_out[:, :-1]], dim=1)
    inputs: list[torch.Tensor] = []

    def keep(module: Any, args: Any, out: torch.Tensor) -> None:
        out.retain_grad()
        inputs.append(out)

    handle = model.embed.register_forward_hook(keep)
    model.train()
    logits = model(src.to(device), tgt_in.to(device))
    loss, _, ntok = label_smoothed_loss(logits, tgt_out.to(device), 0, 0.1)
    (loss / ntok).backward()
    handle.remove()
    grads = {f"input:{name}": t.grad for name, t in zip(("source", "target"), inputs, strict=True)}
    grads.update({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    return {k: v.detach().float().cpu() for k, v in grads.items() if v is not None}


def check_gradients(device: torch.device, candidate: str) -> dict[str, Any]:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    out: dict[str, Any] = {}
    for variant in VARIANTS:
        ref = gradients(tiny(variant, "explicit", device), device)
        got = gradients(tiny(variant, candidate, device), device)
        assert ref.keys() == got.keys(), sorted(set(ref) ^ set(got))
        worst = max(
            (float((got[k] - ref[k]).abs().max()) / max(float(ref[k].abs().max()), 1e-12), k) for k in ref
        )
        positions = sorted(k for k in ref if "positions" in k)
        out[variant] = {"worst_relative": worst[0], "worst_tensor": worst[1], "position_params": positions}
        verdict = "PASS" if worst[0] <= 1e-5 else "FAIL"
        listed = ", ".join(positions) or "none"
        print(f"  {verdict} {variant:<12} {candidate} vs explicit: worst {worst[0]:.2e} ({worst[1]}); "
              f"{len(ref)} tensors, position parameters: {listed}", flush=True)  # fmt: skip
    return out


def summary(bench: dict[str, Any]) -> list[tuple[bool, str]]:
    """The issue's GPU goals from bench_attention's JSON."""
    rows = bench["train"]
    checks: list[tuple[bool, str]] = []
    eager = [r for r in rows if not r["compiled"]]
    for kind in sorted({r["group"] for r in eager}):
        mine = [r for r in eager if r["group"] == kind and r["kind"] == kind]
        best = min(mine, key=lambda r: r["step_ms"])
        base = min(
            (r for r in eager if r["group"] == kind and r["kind"] == "none"), key=lambda r: r["step_ms"]
        )
        ratio = best["step_ms"] / base["step_ms"]
        checks.append(
            (ratio <= 1.10, f"{kind}: best step {best['row']} / best none = {ratio:.2f}x (goal <= 1.10x)")
        )
    for kind in ("t5", "alibi", "shaw"):
        flex = [r for r in eager if r["group"] == kind and r["kind"] == kind and r["backend"] == "flex"]
        dense = [r for r in eager if r["group"] == kind and r["kind"] == kind and r["backend"] == "sdpa"]
        if flex and dense:
            ratio = flex[0]["memory_bytes"] / dense[0]["memory_bytes"]
            checks.append(
                (ratio <= 0.6, f"{kind}: step memory flex / dense-mask sdpa = {ratio:.2f}x (goal <= 0.6x)")
            )
    for r in (r for r in rows if r["compiled"]):
        twin = [
            e
            for e in eager
            if e["group"] == r["group"] and e["kind"] == r["kind"] and e["backend"] == r["backend"]
        ]
        if twin:
            speed = twin[0]["step_ms"] / r["step_ms"]
            checks.append(
                (speed >= 1.3, f"{r['row']}: compiled {speed:.2f}x faster than eager (goal >= 1.3x)")
            )
    best_mfu = max(rows, key=lambda r: r["mfu"])
    mfu = f"best MFU {100 * best_mfu['mfu']:.1f}% ({best_mfu['row']})"
    checks.append((best_mfu["mfu"] >= 0.4, f"{mfu} of the matmul peak measured in the run (goal >= 40%)"))
    return checks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, help="folder for the raw output")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: exercise every code path")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = not args.dry_run
    if gpu and not torch.cuda.is_available():
        print("gpu_attention: no CUDA GPU here; run with --dry-run on the CPU", file=sys.stderr)
        return 2
    device = torch.device("cuda" if gpu else "cpu")
    print(f"1. gradients through {'flex' if gpu else 'sdpa (dry run)'} against explicit, fp32", flush=True)
    grads = check_gradients(device, "flex" if gpu else "sdpa")
    (args.out / "grads.json").write_text(json.dumps(grads, indent=2))
    failures = sum(g["worst_relative"] > 1e-5 for g in grads.values())

    print("\n2. bench_attention.py", flush=True)
    bench_json = args.out / "bench.json"
    if gpu:
        bench_args = ["--preset", "wmt14_en_de_big", "--device", "cuda", "--bf16", "--hf", "--compile-kinds",
                      "t5,rope", "--decode-batch", "64", "--decode-steps", "30"]  # fmt: skip
    else:
        bench_args = ["--preset", "wmt14_en_de_big", "--smoke", "--threads", "1", "--kinds", "t5,rope",
                      "--hf", "--decode", "t5"]  # fmt: skip
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "bench_attention.py"),
        *bench_args,
        "--json",
        str(bench_json),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    (args.out / "bench.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    print(proc.stdout, flush=True)
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        return failures + 1

    print("3. goals", flush=True)
    verdict = "PASS" if not failures else "FAIL"
    lines = [f"gradients {verdict}: {len(grads) - failures}/{len(grads)} encodings within 1e-5"]
    for ok, text in summary(json.loads(bench_json.read_text())):
        lines.append(f"{'PASS' if ok else 'FAIL'} {text}")
        failures += gpu and not ok  # the dry run's CPU figures are not the goals
    text = "\n".join(lines) + ("\n(dry run: figures from the CPU, not the GPU goals)\n" if not gpu else "\n")
    (args.out / "summary.txt").write_text(text)
    print(text)
    return int(failures)


if __name__ == "__main__":
    sys.exit(main())
