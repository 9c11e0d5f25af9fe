"""The GPU checks of attention in one script (at most 8 minutes on one H200, set-up included); CI has no GPU.

    python -m benchmarks.gpu.attention OUT_DIR              # on a machine with a CUDA GPU
    python -m benchmarks.gpu.attention OUT_DIR --dry-run    # the same checks on the CPU, tiny shapes,
                                                            # seconds (the CI smoke test runs it)

1. Gradients (fp32, TF32 off) for every encoding (Shaw with and without relative values): a tiny
   encoder-decoder with padding runs forward + loss + backward through the fused, compiled ``flex``
   kernel at two batch shapes (lengths that change from batch to batch: the dynamic kernel is reused),
   checked by ``tpe_train.model.gradcheck`` against ``explicit`` in fp64: each tensor's error relative
   to its own gradient norm, tensors with an exact zero gradient (the key biases) against the global
   scale; within 1e-4. Dry run: flex cannot run a backward on the CPU, so ``sdpa`` stands in.
2. Decoding through flex: every encoding, incremental decoding with a KV cache (one token a step) at
   two source lengths equals ``explicit``'s full pass (dry run: the CPU's unfused flex, same check).
3. A profiler table of the top kernels of one training step per encoding (``auto``, bf16; the kernel
   names show which SDPA backend ran), and of t5/alibi/shaw through flex.
4. ``bench_attention.py`` at wmt14_en_de_big in bf16 on the GPU, within what is left of the 8 minutes
   (a subprocess timeout); dry run: its small mode for t5 and rope and the HF peers.
5. A summary of the goals, each PASS or FAIL with its figure.

Everything it prints is teed to OUT_DIR/log.txt as it goes (a crash keeps the earlier figures); it
also writes grads.json, flex.json, profile.txt, bench.json, bench.txt, summary.txt (7 files). Commit
OUT_DIR under docs/results/gpu/. The exit status is the number of failed checks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import ROOT, build
from tpe_train.config import load_config
from tpe_train.model import gradcheck
from tpe_train.model.transformer import Transformer
from tpe_train.positions import POSITIONS

# the whole script, set-up excluded (about 30 s of imports and CUDA start); TPE_GPU_BUDGET_S shortens it
# for a shorter slice of GPU time (the bench gets what is left)
BUDGET_S = float(os.environ.get("TPE_GPU_BUDGET_S", 8 * 60 - 30))
GRAD_TOL = 1e-4
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


class Log:
    """print, and append to OUT/log.txt at once (a crash keeps what was printed before it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_text("")

    def __call__(self, *parts: Any) -> None:
        text = " ".join(str(p) for p in parts)
        print(text, flush=True)
        with self.path.open("a") as f:
            f.write(text + "\n")


class Run:
    """One run of a GPU script: its folder, its log (the first line names torch and the device), its
    clock, and the summary it ends with. ``start`` makes one, or says why not."""

    def __init__(self, out: Path, gpu: bool) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.gpu, self.started = out, gpu, time.monotonic()
        self.log = Log(out / "log.txt")
        self.log(f"torch {torch.__version__}, {torch.cuda.get_device_name() if gpu else 'CPU (dry run)'}")

    @classmethod
    def start(cls, out: Path, dry_run: bool, script: str) -> Run | None:
        """A run on the GPU, or on the CPU with ``dry_run``; None, said on stderr, without a GPU."""
        if not dry_run and not torch.cuda.is_available():
            print(f"{script}: no CUDA GPU here; run with --dry-run on the CPU", file=sys.stderr)
            return None
        return cls(out, gpu=not dry_run)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def finish(self, lines: list[str], heading: str) -> None:
        """``lines`` (one per goal) and the time taken to OUT/summary.txt and the log."""
        lines = [*lines, f"total {self.elapsed():.0f} s after set-up"]
        note = "" if self.gpu else "(dry run: figures from the CPU, not the GPU goals)\n"
        text = "\n".join(lines) + "\n" + note
        (self.out / "summary.txt").write_text(text)
        self.log(heading + text)


def batch(shape: tuple[int, int, int], device: torch.device) -> tuple[torch.Tensor, ...]:
    """(src, tgt_in, tgt_out) of ``shape`` = (B, Ls, Lt), padded rows included."""
    rows, ls, lt = shape
    g = torch.Generator().manual_seed(ls * 100 + lt)
    src = torch.randint(3, 50, (rows, ls), generator=g)
    src[1, ls * 2 // 3 :], src[-1, ls // 3 :] = 0, 0  # padding
    tgt_out = torch.randint(3, 50, (rows, lt), generator=g)
    tgt_out[-1, lt // 2 :] = 0
    tgt_in = torch.cat([torch.ones(rows, 1, dtype=torch.long), tgt_out[:, :-1]], dim=1)
    return src.to(device), tgt_in.to(device), tgt_out.to(device)


#: two batch shapes (B, Ls, Lt): the second reuses the dynamic kernels compiled for the first
SHAPES = [(4, 11, 9), (6, 23, 19)]


def check_gradients(device: torch.device, candidate: str, log: Log) -> dict[str, Any]:
    """Every variant through ``candidate`` in fp32 against fp64 ``explicit``, at each of SHAPES."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    out: dict[str, Any] = {}
    for variant in VARIANTS:
        entry: dict[str, Any] = {"worst_relative": float("inf"), "worst_tensor": "", "shapes": []}
        try:
            ref_model = tiny(variant, "explicit", device).double()
            model = tiny(variant, candidate, device)
            for shape in SHAPES:
                data = batch(shape, device)
                start = time.perf_counter()
                got = gradcheck.gradients(model, *data, embed=model.embed)
                seconds = time.perf_counter() - start
                ref = gradcheck.gradients(ref_model, *data, embed=ref_model.embed)
                ok, errors = gradcheck.check(got, ref, GRAD_TOL)
                worst, zero = errors[0], [e.name for e in errors if e.against == "global"]
                entry["shapes"].append({"shape": shape, "ok": ok, "worst": worst.error, "seconds": seconds})
                if shape == SHAPES[0] or worst.error > entry["worst_relative"]:
                    entry.update(worst_relative=worst.error, worst_tensor=worst.name, zero_exact=zero)
                log(
                    f"  {'PASS' if ok else 'FAIL'} {variant:<12} {candidate} vs fp64 explicit at "
                    f"(B, Ls, Lt)={shape}: worst {worst.error:.1e} ({worst.name}, vs {worst.against} "
                    f"scale); {len(errors)} tensors, {len(zero)} with an exact zero gradient; {seconds:.1f} s"
                )
        except Exception as e:  # record and go on: one failure is a figure
            entry["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            log(f"  FAIL {variant:<12} {candidate}: {type(e).__name__}: {str(e)[:300]}")
            log(traceback.format_exc()[-3000:])
        out[variant] = entry
    return out


def check_decoding(device: torch.device, log: Log, dry_run: bool) -> dict[str, Any]:
    """Incremental decoding through flex (one token a step, KV cache) equals explicit's full pass,
    for every variant at two source lengths (dry run: t5 and shaw at one, the CPU's unfused flex
    takes seconds a step)."""
    out: dict[str, Any] = {}
    for variant in ["t5", "shaw"] if dry_run else VARIANTS:
        out[variant] = []
        try:
            flex, explicit = tiny(variant, "flex", device).eval(), tiny(variant, "explicit", device).eval()
            for shape in SHAPES[:1] if dry_run else SHAPES:
                src, tgt_in, _ = batch(shape, device)
                start = time.perf_counter()
                with torch.no_grad():
                    reference = explicit.decode(tgt_in, explicit.encode(src))
                    memory, cache = flex.encode(src), flex.new_cache()
                    steps = [flex.decode(tgt_in[:, i : i + 1], memory, cache) for i in range(tgt_in.shape[1])]
                got = torch.cat(steps, dim=1)
                error = float((got - reference).abs().max())
                seconds = time.perf_counter() - start
                ok = error <= 1e-4
                out[variant].append({"shape": shape, "ok": ok, "max_abs_error": error, "seconds": seconds})
                log(f"  {'PASS' if ok else 'FAIL'} {variant:<12} flex decoding at (B, Ls, Lt)={shape}: "
                    f"max |flex - explicit| {error:.1e}; {seconds:.1f} s")  # fmt: skip
        except Exception as e:
            out[variant].append({"ok": False, "error": f"{type(e).__name__}: {str(e)[:2000]}"})
            log(f"  FAIL {variant:<12} flex decoding: {type(e).__name__}: {str(e)[:300]}")
    return out


def profile(device: torch.device, gpu: bool, log: Log) -> str:
    """The top kernels of one training step (after one warm-up step) per encoding and backend."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    size = ["model.d_model=512", "model.n_heads=8", "model.ffn_dim=2048"]
    rows, length = 64, 48
    runs = [(kind, "auto") for kind in POSITIONS.names()] + [(k, "flex") for k in ("t5", "alibi", "shaw")]
    if not gpu:  # tiny, and no flex backward on the CPU
        size = ["model.d_model=64", "model.n_heads=4", "model.ffn_dim=128", "model.encoder_layers=2",
                "model.decoder_layers=2"]  # fmt: skip
        rows, length, runs = 4, 11, [("none", "auto"), ("rope", "auto"), ("t5", "auto")]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    sort = "self_cuda_time_total" if gpu else "self_cpu_time_total"
    tables = []
    for kind, backend in runs:
        cfg = load_config(None, [*size, "model.dropout=0", "model.attention_dropout=0",
                                 f"model.attention={backend}", f"model.position.kind={kind}",
                                 "data.vocab_size=1000"])  # fmt: skip
        try:
            model = build(cfg, device=device, seed=0).train()
            src, tgt_in, _ = batch((rows, length, length), device)

            def step(m: Transformer = model, s: torch.Tensor = src, t: torch.Tensor = tgt_in) -> None:
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    m(s, t).float().logsumexp(-1).mean().backward()

            step()
            with profiler(activities=activities) as prof:
                step()
                if gpu:
                    torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by=sort, row_limit=8, max_name_column_width=70)
        except Exception as e:
            table = f"{type(e).__name__}: {str(e)[:500]}"
        text = f"== {kind} / {backend}, bf16, (B, L)=({rows}, {length}), top kernels by {sort}\n{table}"
        log(text)
        tables.append(text)
    return "\n".join(tables)


def summary(bench: dict[str, Any]) -> list[tuple[bool, str]]:
    """The GPU goals bench_attention's JSON can show, each (met, text): every encoding's best step
    within 1.10x of ``none``'s; flex's step memory against the dense mask; compiled >= 1.3x eager;
    MFU >= 40%; with Hugging Face rows, each encoding >= 1.3x its Hugging Face peer."""
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
    hf = bench.get("hf") or []
    for ours, peer in zip(hf[0::2], hf[1::2], strict=True):  # tpe's row, then its peer's
        speed = ours["vs_hf"]
        checks.append(
            (speed >= 1.3, f"{ours['row']}: {speed:.2f}x the speed of {peer['row']} (goal >= 1.3x)")
        )
    return checks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, help="folder for the raw output")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: exercise every code path")
    args = p.parse_args(argv)
    run = Run.start(args.out, args.dry_run, "benchmarks.gpu.attention")
    if run is None:
        return 2
    gpu, log = run.gpu, run.log
    device = torch.device("cuda" if gpu else "cpu")
    candidate = "flex" if gpu else "sdpa"
    log(f"1. gradients through {candidate}{'' if gpu else ' (dry run)'} against fp64 explicit, fp32")
    grads = check_gradients(device, candidate, log)
    (args.out / "grads.json").write_text(json.dumps(grads, indent=2))
    failures = sum(not all(s["ok"] for s in g["shapes"]) or "error" in g for g in grads.values())

    log("\n2. decoding through flex against explicit")
    decoding = check_decoding(device, log, args.dry_run)
    (args.out / "flex.json").write_text(json.dumps({"training": grads, "decoding": decoding}, indent=2))
    decode_failures = sum(not all(r["ok"] for r in rows) for rows in decoding.values())

    log("\n3. profiler: top kernels of one training step per encoding")
    (args.out / "profile.txt").write_text(profile(device, gpu, log))

    log("\n4. bench_attention.py", f"({run.elapsed():.0f} s so far)")
    bench_json = args.out / "bench.json"
    if gpu:
        bench_args = ["--preset", "wmt14_en_de_big", "--device", "cuda", "--bf16", "--backends", "sdpa,flex",
                      "--compile-kinds", "t5,rope", "--compile-backends", "sdpa", "--decode", "t5,alibi",
                      "--decode-batch", "64", "--decode-steps", "30", "--steps", "2"]  # fmt: skip
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
    left = max(30.0, BUDGET_S - run.elapsed())
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=left)
        stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        stderr, code = f"stopped after {left:.0f} s (the script's 8-minute budget)", -1
    (args.out / "bench.txt").write_text(stdout + "\n--- stderr ---\n" + stderr)
    log(stdout)
    if code != 0:
        log(stderr[-4000:])

    lines = [
        f"{'PASS' if not failures else 'FAIL'} gradients: {len(grads) - failures}/{len(grads)} variants "
        f"within {GRAD_TOL:g} of fp64 explicit at {len(SHAPES)} batch shapes",
        f"{'PASS' if not decode_failures else 'FAIL'} flex decoding: {len(decoding) - decode_failures}/"
        f"{len(decoding)} variants equal explicit at {max(len(r) for r in decoding.values())} length(s)",
    ]
    failures += decode_failures
    if code == 0 and bench_json.exists():
        for ok, text in summary(json.loads(bench_json.read_text())):
            lines.append(f"{'PASS' if ok else 'FAIL'} {text}")
            failures += gpu and not ok  # the dry run's CPU figures are not the goals
    else:
        lines.append(f"FAIL bench_attention.py exited with {code} (see bench.txt)")
        failures += 1
    run.finish(lines, "5. goals\n")
    return int(failures)


if __name__ == "__main__":
    sys.exit(main())
