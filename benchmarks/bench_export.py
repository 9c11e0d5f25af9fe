"""Deployment speed and quality of one trained model in four engines, in one run, on the Multi30k test
set: ``tpe-translate``'s decoder (in process), Hugging Face ``generate`` on the model's HF export, and
CTranslate2 on its float32 and int8 exports; sentences/s and BLEU of each, with the same beam and
length penalty.

Run from the repository root (throughput is only comparable *within one run*)::

    python benchmarks/bench_export.py --checkpoint runs/m30k-ens/runs/s1/sinusoidal/averaged-last5
    python benchmarks/bench_export.py --checkpoint DIR --repeats 5 --json out.json
    python benchmarks/bench_export.py --smoke --json out.json  # small mode: tiny random model, 20 lines

What is measured
----------------
``--checkpoint``: an export directory (``load_export``: model.safetensors, config.yaml, tokenizer.json);
``--data``: the folder of ``test_2016_flickr.{en,de}`` (default ``../shared/data/multi30k`` from the
repository root), or ``checkpoint``: the test set of the checkpoint's own config (the embedded corpus's
1,000 test pairs for a model of the demo). The exports are written first, into a temporary directory
(their time and size are reported), by ``tpe-ckpt export --format hf`` and ``--format ctranslate2
--quantization float32|int8`` (``tpe_train.ckpt.cli``, in process). Decoding settings: the checkpoint's
``eval`` section (beam 4, GNMT length penalty alpha 0.6, at most source + EOS + 50 tokens, batches of
``max_tokens`` padded source tokens), or ``--beam``.

Rows, each a pass over the whole test set from text to text, tokenisation and detokenisation included:

- ``tpe-translate``: ``decode_sentences``, what the command runs on the lines it reads.
- ``hf-generate``: the HF export loaded by ``AutoTokenizer`` and ``AutoModelForSeq2SeqLM``, decoded by
  ``tpe_train.ckpt.hf.generate`` on tpe-translate's length-sorted batches: ``generate`` with the beam,
  ``length_penalty`` alpha (divided by length^alpha, not GNMT's ((5 + length) / 6)^alpha) and
  tpe-translate's per-sentence length cap (``LengthCap``).
- ``ct2-float32``, ``ct2-int8``: ``tpe_train.ckpt.ct2.translate`` on a ``ctranslate2.Translator``
  (``intra_threads`` = ``--threads``, one translation at a time): CTranslate2's greedy or beam search,
  its finished hypotheses re-ranked by the GNMT penalty (see that module for what can differ).

Timing: every row is warmed up with one untimed pass, then ``--repeats`` rounds of one timed pass per
row, the row order rotated each round (``harness.interleave``); reported: median seconds per pass,
sentences/s, and the ratio to ``tpe-translate`` of the same run. Quality: sacreBLEU (default 13a) of each
row's output against the references; sentences identical to ``tpe-translate``'s output, and how many of
the others reached tpe-translate's length limit; a paired bootstrap (1,000 resamples, sacreBLEU's seed)
of each row against ``tpe-translate``. Every pass of a row must give the same output (checked).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from harness import (
    ROOT,
    FnRow,
    bench_config,
    build,
    environment,
    interleave,
    loadavg,
    write_json,
    write_pairs,
)

from tpe_train.ckpt.export import WEIGHTS, load_export, save_export
from tpe_train.data.batching import EOS_ID
from tpe_train.data.specs import corpus_spec
from tpe_train.data.splits import test_splits
from tpe_train.data.tokenizer import PAD, train_tokenizer
from tpe_train.evaluation.decoding import DecodeOptions, decode_sentences, read_lines, token_batches
from tpe_train.evaluation.metrics import bleu, paired_bootstrap

DEFAULT_DATA = ROOT.parent / "shared" / "data" / "multi30k"
DEFAULT_CHECKPOINT = ROOT / "runs" / "m30k-ens" / "runs" / "s1" / "sinusoidal" / "averaged-last5"
TEST = "test_2016_flickr"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from harness import parse_with_smoke

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--checkpoint", type=Path, default=DEFAULT_CHECKPOINT, help="an export (default: %(default)s)"
    )
    p.add_argument(
        "--data", type=Path, default=DEFAULT_DATA, help="test_2016_flickr.{en,de}'s folder, or checkpoint"
    )
    p.add_argument("--lines", type=int, default=0, help="only the first N lines (0: all)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per row (median reported)")
    p.add_argument("--beam", type=int, default=0, help="beam size (0: the checkpoint's eval.beam)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of every engine")
    p.add_argument("--json", type=Path, default=None, help="also write every number here")
    # small mode: a tiny random model (harness.SMOKE_SHAPE) on 20 generated lines, one repeat
    return parse_with_smoke(p, argv, {"lines": 20, "repeats": 1})


def revision() -> str:
    """The commit this runs, with ``+dirty`` when tracked files differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def cpu_model() -> str:
    """The processor's model name (/proc/cpuinfo), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def smoke_checkpoint(directory: Path) -> tuple[Path, Path]:
    """A tiny random model (``harness.SMOKE_SHAPE``) exported to ``directory/export``, its tokenizer
    trained on generated pairs, and 20 generated test pairs in ``directory/data``."""
    data = directory / "data"
    write_pairs(data / f"{TEST}.en", data / f"{TEST}.de", 20, seed=4)
    write_pairs(directory / "train.en", directory / "train.de", 200, seed=3)
    text = [*read_lines(directory / "train.en"), *read_lines(directory / "train.de")]
    cfg = bench_config(smoke=True)
    tok = train_tokenizer(text, cfg.data.vocab_size)
    model = build(cfg, "sinusoidal", vocab=tok.get_vocab_size()).eval()
    return save_export(directory / "export", model, cfg, tok, step=0), data


def cli_export(checkpoint: Path, out: Path, fmt: str, quantization: str | None = None) -> tuple[float, str]:
    """``tpe-ckpt export CHECKPOINT --out OUT --format FMT`` in process: its seconds, and "" or why not."""
    from tpe_train.ckpt.cli import main as ckpt_main

    argv = ["export", str(checkpoint), "--out", str(out), "--format", fmt]
    if quantization:
        argv += ["--quantization", quantization]
    start = time.perf_counter()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ckpt_main(argv)
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            return (
                0.0,
                f"tpe-ckpt {' '.join(argv[:1])} --format {fmt} failed: {err.getvalue().strip()[-300:]}",
            )
    return time.perf_counter() - start, ""


def size_mb(directory: Path, names: tuple[str, ...]) -> float:
    return sum((directory / n).stat().st_size for n in names if (directory / n).is_file()) / 2**20


def hf_translator(directory: Path, options: DecodeOptions) -> Callable[[list[str]], list[str]]:
    """``generate`` of the HF export on our batches (see the module's docstring)."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from tpe_train.ckpt.hf import generate

    hf_tok = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForSeq2SeqLM.from_pretrained(directory).eval()
    o = options

    def translate(lines: list[str]) -> list[str]:
        ids = hf_tok(lines, add_special_tokens=True)["input_ids"]
        seqs = [s if s and s[-1] == EOS_ID else [*s, EOS_ID] for s in ids]  # the source ends with EOS
        out = [""] * len(lines)
        for batch in token_batches([len(s) for s in seqs], o.max_tokens, o.batch_size):
            hyps = generate(model, [seqs[i] for i in batch], o.beam, o.alpha, o.max_len_a, o.max_len_b)
            for i, text in zip(batch, hf_tok.batch_decode(hyps, skip_special_tokens=True), strict=True):
                out[i] = text
        return out

    return translate


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import ctranslate2

    from tpe_train.ckpt.ct2 import best_pieces, detokenize, limits

    torch.set_num_threads(args.threads)
    if args.smoke and args.checkpoint == DEFAULT_CHECKPOINT:
        args.checkpoint, args.data = smoke_checkpoint(tmp)
    own = str(args.data) == "checkpoint"
    files = [] if own else [args.data / f"{TEST}.en", args.data / f"{TEST}.de"]
    for path in (args.checkpoint, *files):
        if not path.exists():
            sys.exit(f"bench_export: {path} not found; pass --checkpoint EXPORT_DIR and --data MULTI30K_DIR")
    model, cfg, tok = load_export(args.checkpoint)
    if own:
        test = test_splits(corpus_spec(cfg.data)).test
        sources, refs = [src for src, _ in test], [tgt for _, tgt in test]
    else:
        sources, refs = read_lines(files[0]), read_lines(files[1])
    if args.lines:
        sources, refs = sources[: args.lines], refs[: args.lines]
    options = DecodeOptions.of(cfg.eval, **({"beam": args.beam} if args.beam else {}))
    env = environment(torch.device("cpu"), ctranslate2=ctranslate2.__version__,
                      transformers=__import__("transformers").__version__)  # fmt: skip
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = {
        "command": " ".join(["python", "benchmarks/bench_export.py", *sys.argv[1:]]),
        "revision": revision(),
        "date": started,
        "machine": f"{cpu_model()}, {env['cpus']} CPUs visible",
        "note": "the machine may be shared with other work while this runs: compare the ratios within "
        "this run, not absolute figures across runs (load averages at start and end are recorded)",
        "checkpoint": str(args.checkpoint),
        "lines": len(sources),
        "decoding": {
            k: getattr(options, k) for k in ("beam", "alpha", "max_len_a", "max_len_b", "max_tokens")
        },
    }
    for key, value in header.items():
        print(f"{key}: {value}")
    print(f"env: {env}")

    exports: dict[str, dict[str, Any]] = {
        "tpe-translate": {"mb": size_mb(args.checkpoint, ("model.safetensors",))}
    }
    rows: list[FnRow] = []

    outputs: dict[str, list[list[str]]] = {}
    ends: list[int] = []  # tpe-translate's output tokens per sentence

    def keep(name: str, fn: Callable[[], list[str]]) -> FnRow:
        """A row that keeps every pass's output (they must agree)."""
        outputs[name] = []
        return FnRow(name, lambda: outputs[name].append(fn()))

    def ours() -> list[str]:
        found = decode_sentences(model, tok, sources, options)  # what tpe-translate runs per chunk
        ends[:] = [t.output_tokens for t in found]
        return [t.text or "" for t in found]

    rows.append(keep("tpe-translate", ours))
    pads: dict[str, int] = {}  # CTranslate2's best hypotheses holding <pad>
    hf_dir = tmp / "hf"
    seconds, why = cli_export(args.checkpoint, hf_dir, "hf")
    if why:
        print(f"hf-generate: no row ({why})")
        exports["hf-generate"] = {"missing": why}
    else:
        exports["hf-generate"] = {"export_s": seconds, "mb": size_mb(hf_dir, (WEIGHTS,))}
        hf = hf_translator(hf_dir, options)
        rows.append(keep("hf-generate", lambda: hf(sources)))
    for q in ("float32", "int8"):
        directory = tmp / f"ct2-{q}"
        seconds, why = cli_export(args.checkpoint, directory, "ctranslate2", q)
        if why:  # the CLI may not take --format ctranslate2 yet: the function itself
            from tpe_train.ckpt.ct2 import export_ctranslate2

            start = time.perf_counter()
            export_ctranslate2(model, cfg, tok, directory, q)
            seconds = time.perf_counter() - start
        exports[f"ct2-{q}"] = {"export_s": seconds, "mb": size_mb(directory, ("model.bin",))}
        translator = ctranslate2.Translator(
            str(directory), device="cpu", inter_threads=1, intra_threads=args.threads
        )

        def ct2(tr: Any = translator, name: str = f"ct2-{q}") -> list[str]:
            o = options
            best = best_pieces(tr, tok, sources, o.beam, o.alpha, o.max_len_a, o.max_len_b, o.max_tokens,
                               model.max_target_length())  # fmt: skip
            pads[name] = sum(PAD in hyp for hyp in best)  # a piece ours never continues with
            return detokenize(tok, best)

        rows.append(keep(f"ct2-{q}", ct2))
    interleave(rows, 1, args.repeats, torch.device("cpu"), "export", collect="never", cpu_time=True)
    env["loadavg_at_end"] = loadavg()

    base = outputs["tpe-translate"][-1]
    steps = limits([len(e.ids) for e in tok.encode_batch(sources, add_special_tokens=False)],
                   options.max_len_a, options.max_len_b, model.max_target_length())  # fmt: skip
    limited = {i for i, (n, s) in enumerate(zip(ends, steps, strict=True)) if n >= s - 1}  # EOS forced
    at_limit = len(limited)
    results = []
    base_s = statistics.median(rows[0].times)
    for row in rows:
        hyps = outputs[row.name][-1]
        score, signature = bleu(hyps, refs)
        median = statistics.median(row.times)
        entry = {
            "name": row.name,
            "seconds": median,
            "cpu_seconds": statistics.median(row.cpu_times),
            "sentences_per_s": len(sources) / median,
            "speedup_vs_tpe": base_s / median,
            "bleu": score,
            "identical_to_tpe": sum(a == b for a, b in zip(hyps, base, strict=True)),
            "different_at_tpe_limit": sum(hyps[i] != base[i] for i in limited),
            "passes_agree": all(o == hyps for o in outputs[row.name]),
            "all_seconds": row.times,
            **exports[row.name],
        }
        if row.name in pads:
            entry["hypotheses_with_pad"] = pads[row.name]
        if row.name != "tpe-translate":
            entry["paired_vs_tpe"] = paired_bootstrap(hyps, base, refs).as_dict()["bleu"]
        results.append(entry)
    print(f"\nBLEU signature: {signature}")
    print(f"tpe-translate hypotheses that reached the length limit: {at_limit}")
    print(
        "\n| engine | s/pass | sentences/s | vs tpe-translate | BLEU | identical to tpe-translate | size MB |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['name']} | {r['seconds']:.2f} | {r['sentences_per_s']:.1f} | {r['speedup_vs_tpe']:.2f}x | "
            f"{r['bleu']:.2f} | {r['identical_to_tpe']}/{len(sources)} | {r['mb']:.1f} |"
        )
    for r in results[1:]:
        p = r["paired_vs_tpe"]
        print(f"{r['name']}: BLEU {p['delta']:+.2f} vs tpe-translate, paired bootstrap p {p['p_value']:.3f}")
    print(f"every row's passes gave the same output: {all(r['passes_agree'] for r in results)}")
    print(f"CTranslate2 best hypotheses holding <pad>: {pads}")
    for r in results[1:]:
        n, at = len(sources) - r["identical_to_tpe"], r["different_at_tpe_limit"]
        print(f"{r['name']}: {n} sentences differ from tpe-translate's, {at} of them at its length limit")
    for name, info in exports.items():
        if "missing" in info:
            print(f"{name}: not measured ({info['missing']})")
    print(f"load average at start {env['loadavg_at_start']}, at end {env['loadavg_at_end']}")
    return {
        **header,
        "env": env,
        "bleu_signature": signature,
        "tpe_at_length_limit": at_limit,
        "rows": results,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        payload = run(args, Path(tmp))
    write_json(args.json, payload)


if __name__ == "__main__":
    main()
