"""Translation throughput of ``tpe-translate``'s pipeline against Hugging Face ``generate``, same model
shape, same beam, same batches, same number of decoder steps per sentence, on a real test set.

Run from the repository root (the numbers are only comparable *within one run*)::

    python benchmarks/bench_translate.py                        # newstest2014.en of ../shared, 3 rounds
    python benchmarks/bench_translate.py --lines 500 --rounds 2 # quicker
    python benchmarks/bench_translate.py --device cuda --json out.json

What is measured
----------------
Source: the newstest2014 English file (3,003 lines; ``--source`` names another), tokenised with a joint
BPE of 8,000 (``tokenizers``, trained here on newstest2014 en + de, the same file for both sides).
Models: the shape of ``bench_train.py`` (d_model 256, 4 heads, FFN 1024, 3 + 3 layers, vocabulary 8,000,
tied embeddings), random weights with a fixed seed: tpe_train's ``sinusoidal`` Transformer and Hugging
Face's MarianMT (sinusoidal too), both in eval mode, fp32.

- tpe_train: ``translate_stream`` (what ``tpe-translate`` runs after loading the export: lines ->
  tokens -> length-sorted batches of at most ``max_tokens`` padded source tokens -> beam search ->
  detokenised lines in input order), beam 4, length penalty 0.6.
- Hugging Face: the same tokens in the same batches (``decoding.token_batches``), ``generate(num_beams=4,
  length_penalty=0.6, suppress_tokens=[pad])`` per batch, detokenised and put back in input order.

Random weights stop at arbitrary lengths, so (as ``bench_train.py`` does for fixed-length batches) both
sides are made to decode exactly the same number of steps per sentence, chosen as a trained model would
roughly stop: sentence i gets as many output tokens as its reference translation has (newstest2014.de,
same BPE), then EOS (``--lengths reference``, the default). Batches are cut by source length, so the
output lengths within a batch vary as they do in real decoding. ``--lengths source`` instead gives every
sentence as many output tokens as its source has (EOS included): sentences of one batch then end almost
together, which leaves only the per-step cost to compare. tpe_train: the EOS logit is lowered by 10^4
(never chosen) and the beam search's length limit (``generate._max_lengths``, patched here) is the
planned length, where the search forces EOS as it does for any sentence; Hugging Face: a logits
processor removes EOS before the planned step of each sentence and forces it there. Each side keeps its
own batch behaviour: tpe_train drops a finished sentence from its batch, Hugging Face pads it until the
batch is done. Both sides' output lengths are checked against the plan, sentence by sentence.

Rounds alternate the two sides (order swapped every round); reported: median seconds per pass over the
file, sentences/s, output tokens/s and the ratio tpe / HF (> 1: tpe-translate faster).

fairseq-interactive is not measured: fairseq 0.12.2 (the last release) pins omegaconf < 2.1 and
hydra-core 1.0 (this project needs omegaconf >= 2.3), and pip would add torchaudio 2.11 against torch
2.13; it does not install cleanly beside this project on Python 3.11.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:  # run as a script from a checkout without installing the package
        sys.path.insert(0, str(path))

from bench_train import EOS, PAD, VOCAB, hf_model, tpe_model  # noqa: E402

from tpe_train.config import EvalConfig  # noqa: E402
from tpe_train.data.batching import pad  # noqa: E402
from tpe_train.data.tokenizer import decode, encode, train_tokenizer  # noqa: E402
from tpe_train.evaluation.decoding import DecodeOptions, decode_sentences, read_lines, token_batches  # noqa: E402
from tpe_train.evaluation.translate import translate_stream  # noqa: E402
from tpe_train.model import generate  # noqa: E402
from tpe_train.model.transformer import Memory, Transformer  # noqa: E402

DEFAULT_SOURCE = Path("../shared/data/newstest2014-en-de/newstest2014.en")
EOS_PENALTY = 1e4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="source file (default: %(default)s)")
    p.add_argument("--target", type=Path, default=None, help="its reference (default: the .de beside it)")
    p.add_argument("--lines", type=int, default=0, help="only the first N lines (0: all)")
    p.add_argument(
        "--lengths",
        choices=["reference", "source"],
        default="reference",
        help="output tokens per sentence: its reference's (default) or its source's",
    )
    p.add_argument("--rounds", type=int, default=3, help="timed passes over the file per side")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", type=Path, default=None, help="also write every number here")
    return p.parse_args(argv)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def lower_eos(model: Transformer) -> Transformer:
    """EOS is never chosen (its logit lowered by 10^4); the length limit still forces it at the end."""
    inner = model.decode

    def decode_(tgt_in: Tensor, memory: Memory, cache: Any = None) -> Tensor:
        logits = inner(tgt_in, memory, cache)
        logits[..., EOS] -= EOS_PENALTY
        return logits

    model.decode = decode_  # type: ignore[method-assign]
    return model


def plan_lengths(planned: dict[tuple[int, ...], int]) -> None:
    """tpe_train's beam search ends each sentence after its planned output tokens: the length limit
    (decoder calls, EOS included) of a source row is looked up by its tokens."""

    def limits(model: Transformer, src: Tensor, max_len_a: float, max_len_b: int) -> Tensor:
        rows = [tuple(t for t in row if t != PAD)[:-1] for row in src.tolist()]  # without pad and EOS
        return torch.tensor([planned[row] + 1 for row in rows], device=src.device)

    generate._max_lengths = limits  # type: ignore[assignment]


class ExactLength:
    """Hugging Face logits processor: sentence b of the batch ends at decoder call ``calls[b]`` (EOS
    removed before, forced there and after)."""

    def __init__(self, calls: Tensor, beams: int) -> None:
        self.calls = calls.repeat_interleave(beams)  # (B * K,) rows as generate lays them out

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        call = input_ids.shape[1]  # the decoder start token plus what was generated: this call's number
        calls = self.calls.to(scores.device)
        early = calls > call
        scores[early, EOS] = float("-inf")
        end = ~early
        if bool(end.any()):
            scores[end] = float("-inf")
            scores[end, EOS] = 0.0
        return scores


def hf_translator(
    model: Any, tok: Any, options: DecodeOptions, device: torch.device, planned: dict[tuple[int, ...], int]
) -> Callable[..., Any]:
    from transformers import GenerationConfig, LogitsProcessorList

    def translate(lines: list[str]) -> tuple[list[str], list[int]]:
        seqs = [[*s, EOS] for s in encode(tok, lines)]
        texts: list[str] = [""] * len(lines)
        lengths = [0] * len(lines)
        for batch in token_batches([len(s) for s in seqs], options.max_tokens, options.batch_size):
            src = pad([seqs[i] for i in batch]).to(device)
            calls = torch.tensor([planned[tuple(seqs[i][:-1])] + 1 for i in batch])  # tokens + EOS
            config = GenerationConfig(
                num_beams=options.beam,
                length_penalty=options.alpha,
                max_new_tokens=int(calls.max()),
                do_sample=False,
                early_stopping=False,
                suppress_tokens=[PAD],
                use_cache=True,
                pad_token_id=PAD,
                bos_token_id=1,
                eos_token_id=EOS,
                decoder_start_token_id=1,
            )
            with torch.inference_mode():
                out = model.generate(
                    input_ids=src,
                    attention_mask=(src != PAD).long(),
                    generation_config=config,
                    logits_processor=LogitsProcessorList([ExactLength(calls, options.beam)]),
                )
            hyps = []
            for row in out[:, 1:].tolist():
                hyps.append(row[: row.index(EOS)] if EOS in row else [t for t in row if t != PAD])
            for i, hyp, text in zip(batch, hyps, decode(tok, hyps), strict=True):
                texts[i], lengths[i] = text, len(hyp)
        return texts, lengths

    return translate


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    if not args.source.is_file():
        sys.exit(f"{args.source} not found: pass --source PATH (newstest2014.en of the shared data)")
    target = args.target or args.source.with_suffix(".de")
    if args.lengths == "reference" and not target.is_file():
        sys.exit(f"{target} not found: --lengths reference needs the reference (--target PATH)")
    lines = read_lines(args.source)
    if args.lines:
        lines = lines[: args.lines]
    both = [*read_lines(args.source), *(read_lines(target) if target.is_file() else [])]
    tok = train_tokenizer(both, VOCAB)
    defaults = EvalConfig()
    options = DecodeOptions(args.beam, 0.6, 1.0, 1, defaults.max_tokens, defaults.batch_size)
    sources = encode(tok, lines)
    if args.lengths == "reference":
        refs = encode(tok, read_lines(target)[: len(lines)])
        lengths = [max(1, len(r)) for r in refs]
    else:
        lengths = [len(s) + 1 for s in sources]
    planned: dict[tuple[int, ...], int] = {}
    for seq, n in zip(sources, lengths, strict=True):
        planned.setdefault(tuple(seq), n)  # a source that occurs twice keeps its first plan
    expected = [planned[tuple(seq)] for seq in sources]  # output tokens per sentence, EOS excluded
    plan_lengths(planned)
    tpe = lower_eos(tpe_model("sinusoidal")).to(device).eval()
    hf = hf_model("hf-marian").to(device).eval()
    hf_translate = hf_translator(hf, tok, options, device, planned)
    src_tokens = sum(len(s) + 1 for s in encode(tok, lines))
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    env = {
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "loadavg_at_start": load,
    }
    print(f"env: {env}")
    print(
        f"source: {args.source} ({len(lines)} lines, {src_tokens} tokens with EOS, vocab "
        f"{tok.get_vocab_size()}); beam {args.beam}, max_tokens {options.max_tokens}, batch_size "
        f"{options.batch_size}; {args.rounds} rounds; output lengths: the {args.lengths}'s "
        f"({sum(expected)} tokens + EOS per sentence)"
    )

    # warm-up on the first lines (decode_sentences is what translate_stream runs), which also checks
    # sentence by sentence that both sides decode the planned lengths
    head = lines[:32]
    tpe_lengths = [t.output_tokens for t in decode_sentences(tpe, tok, head, options)]
    hf_lengths = hf_translate(head)[1]
    same = tpe_lengths == hf_lengths == expected[: len(head)]
    print(f"warm-up, {len(head)} lines: output tokens per sentence as planned on both sides: {same}")
    out_tokens = sum(expected)

    def tpe_pass() -> int:
        return translate_stream(tpe, tok, iter(lines), io.StringIO(), options).output_tokens

    def hf_pass() -> int:
        lengths = hf_translate(lines)[1]
        assert lengths == expected, "Hugging Face decoded other lengths than planned"
        return sum(lengths)

    times: dict[str, list[float]] = {"tpe-translate": [], "hf-generate": []}
    cpu: dict[str, list[float]] = {"tpe-translate": [], "hf-generate": []}
    runs: dict[str, Callable[[], int]] = {"tpe-translate": tpe_pass, "hf-generate": hf_pass}
    order = list(runs)
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            tokens = runs[name]()
            sync(device)
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            assert tokens == out_tokens, f"{name}: {tokens} output tokens, planned {out_tokens}"
            print(
                f"  round {r + 1}: {name} {times[name][-1]:.1f} s (process CPU {cpu[name][-1]:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
    rows = []
    for name, ts in times.items():
        median = statistics.median(ts)
        rows.append({"name": name, "seconds": median, "cpu_seconds": statistics.median(cpu[name]),
                     "sentences_per_s": len(lines) / median,
                     "output_tokens_per_s": (out_tokens + len(lines)) / median, "all": ts})  # fmt: skip
    ratio = rows[1]["seconds"] / rows[0]["seconds"]
    cpu_ratio = rows[1]["cpu_seconds"] / rows[0]["cpu_seconds"]
    print(f"\n{'':16}{'s/pass':>10}{'CPU s/pass':>12}{'sentences/s':>14}{'tokens/s':>12}")
    for row in rows:
        print(
            f"{row['name']:16}{row['seconds']:>10.2f}{row['cpu_seconds']:>12.2f}{row['sentences_per_s']:>14.2f}"
            f"{row['output_tokens_per_s']:>12.0f}"
        )
    print(
        f"tpe-translate / HF generate: {ratio:.2f}x sentences/s (wall, median pass), {cpu_ratio:.2f}x by "
        "process CPU time; tokens/s count output tokens + EOS; every sentence decoded to the planned length"
    )
    if hasattr(os, "getloadavg"):
        env["loadavg_at_end"] = os.getloadavg()
        print(f"load average at start {env['loadavg_at_start']}, at end {env['loadavg_at_end']}")
    if args.json:
        payload = {"env": env, "lines": len(lines), "source_tokens": src_tokens, "output_tokens": out_tokens,
                   "same_lengths": same, "rows": rows, "ratio": ratio, "cpu_ratio": cpu_ratio}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
