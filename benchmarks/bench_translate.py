"""Translation throughput of ``tpe-translate``'s pipeline against Hugging Face ``generate``, same model
shape, same beam, same batches, same number of decoder steps per sentence, on a real test set.

Run from the repository root (the numbers are only comparable *within one run*)::

    python benchmarks/bench_translate.py                        # newstest2014.en of ../shared, 3 rounds
    python benchmarks/bench_translate.py --lines 500 --rounds 2 # quicker
    python benchmarks/bench_translate.py --device cuda --json out.json
    python benchmarks/bench_translate.py --smoke --json out.json  # small mode: generated text, tiny model

What is measured
----------------
Source: the newstest2014 English file (3,003 lines; ``--source`` names another), tokenised with a joint
BPE of 8,000 (``tokenizers``, trained here on newstest2014 en + de, the same file for both sides).
Models: the shape of ``bench_train.py`` (``harness.BENCH_SHAPE``: d_model 256, 4 heads, FFN 1024, 3 + 3
layers, vocabulary 8,000, tied embeddings), random weights with a fixed seed: tpe_train's ``sinusoidal``
Transformer and Hugging Face's MarianMT (sinusoidal too, ``peers.py``), both in eval mode, fp32.

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
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from harness import (
    EOS,
    PAD,
    FnRow,
    bench_config,
    build,
    environment,
    interleave,
    loadavg,
    model_args,
    p90,
    parse_with_smoke,
    shared_data_stub,
    write_json,
)
from peers import ExactLength, generation_config, hf_model, suppress_eos
from torch import Tensor

from tpe_train.config import EvalConfig
from tpe_train.data.batching import pad
from tpe_train.data.tokenizer import decode, encode, train_tokenizer
from tpe_train.evaluation.decoding import DecodeOptions, decode_sentences, read_lines, token_batches
from tpe_train.evaluation.translate import translate_stream
from tpe_train.model import generate
from tpe_train.model.transformer import Transformer

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
    # small mode: a tiny model (harness.SMOKE_SHAPE) on generated text (harness.shared_data_stub)
    # unless --source
    return parse_with_smoke(p, argv, {"source": None, "lines": 24, "rounds": 1})


def plan_lengths(planned: dict[tuple[int, ...], int]) -> None:
    """tpe_train's beam search ends each sentence after its planned output tokens: the length limit
    (decoder calls, EOS included) of a source row is looked up by its tokens."""

    def limits(model: Transformer, src: Tensor, max_len_a: float, max_len_b: int) -> Tensor:
        rows = [tuple(t for t in row if t != PAD)[:-1] for row in src.tolist()]  # without pad and EOS
        return torch.tensor([planned[row] + 1 for row in rows], device=src.device)

    generate._max_lengths = limits  # type: ignore[assignment]


def hf_translator(
    model: Any, tok: Any, options: DecodeOptions, device: torch.device, planned: dict[tuple[int, ...], int]
) -> Callable[..., Any]:
    from transformers import LogitsProcessorList

    def translate(lines: list[str]) -> tuple[list[str], list[int]]:
        seqs = [[*s, EOS] for s in encode(tok, lines)]
        texts: list[str] = [""] * len(lines)
        lengths = [0] * len(lines)
        for batch in token_batches([len(s) for s in seqs], options.max_tokens, options.batch_size):
            src = pad([seqs[i] for i in batch]).to(device)
            calls = torch.tensor([planned[tuple(seqs[i][:-1])] + 1 for i in batch])  # tokens + EOS
            config = generation_config(options.beam, options.alpha, int(calls.max()))
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
    with tempfile.TemporaryDirectory(prefix="bench-translate-") as tmp:
        if args.source is None:  # --smoke without --source
            args.source = shared_data_stub(Path(tmp)) / "newstest2014-en-de" / "newstest2014.en"
        run(args)


def run(args: argparse.Namespace) -> None:
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
    cfg = bench_config(args.smoke)
    both = [*read_lines(args.source), *(read_lines(target) if target.is_file() else [])]
    tok = train_tokenizer(both, cfg.data.vocab_size)
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
    # EOS is never chosen (its logit lowered by 10^4); the length limit still forces it at the end
    tpe = suppress_eos(build(cfg, "sinusoidal"), penalty=EOS_PENALTY).to(device).eval()
    hf = hf_model("hf-marian", model_args(cfg)).to(device).eval()
    hf_translate = hf_translator(hf, tok, options, device, planned)
    src_tokens = sum(len(s) + 1 for s in encode(tok, lines))
    env = environment(device, transformers=__import__("transformers").__version__)
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

    def tpe_pass() -> None:
        tokens = translate_stream(tpe, tok, iter(lines), io.StringIO(), options).output_tokens
        assert tokens == out_tokens, f"tpe-translate: {tokens} output tokens, planned {out_tokens}"

    def hf_pass() -> None:
        lengths = hf_translate(lines)[1]
        assert lengths == expected, "Hugging Face decoded other lengths than planned"

    # rounds alternate the two sides (two rows: the order swaps every round); no warm-up steps here
    sides = [FnRow("tpe-translate", tpe_pass), FnRow("hf-generate", hf_pass)]
    interleave(sides, 0, args.rounds, device, "translate", collect="never", cpu_time=True)
    rows = []
    for side in sides:
        median = statistics.median(side.times)
        rows.append(
            {
                "name": side.name,
                "seconds": median,
                "seconds_p90": p90(side.times),
                "cpu_seconds": statistics.median(side.cpu_times),
                "sentences_per_s": len(lines) / median,
                "output_tokens_per_s": (out_tokens + len(lines)) / median,
                "all": side.times,
            }
        )
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
    env["loadavg_at_end"] = loadavg()
    print(f"load average at start {env['loadavg_at_start']}, at end {env['loadavg_at_end']}")
    payload = {"env": env, "lines": len(lines), "source_tokens": src_tokens, "output_tokens": out_tokens,
               "same_lengths": same, "rows": rows, "ratio": ratio, "cpu_ratio": cpu_ratio}  # fmt: skip
    write_json(args.json, payload)


if __name__ == "__main__":
    main()
