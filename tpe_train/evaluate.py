"""Translate and score: sacreBLEU (with signature), chrF, exact match, word-order probe accuracy,
BLEU by source-length bucket. ``tpe-eval --checkpoint DIR [--json]``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
from sacrebleu.metrics import BLEU, CHRF
from tokenizers import Tokenizer

from tpe_train.config import ConfigError, EvalConfig
from tpe_train.data.batching import EOS_ID, pad
from tpe_train.data.corpus import Splits, test_splits
from tpe_train.data.tokenizer import decode, encode
from tpe_train.model.generate import beam_search, greedy
from tpe_train.model.transformer import Transformer


def translate(
    model: Transformer,
    tok: Tokenizer,
    sources: list[str],
    ecfg: EvalConfig,
    beam: int | None = None,
) -> list[str | None]:
    """Translate ``sources``; ``None`` for a source longer than the encoder can represent."""
    beam = ecfg.beam if beam is None else beam
    ids = [[*s, EOS_ID] for s in encode(tok, sources)]
    limit = model.max_source_length()
    out: list[str | None] = [None] * len(sources)
    todo = [i for i, s in enumerate(ids) if limit is None or len(s) <= limit]
    todo.sort(key=lambda i: len(ids[i]))  # similar lengths share a batch: little padding
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    for start in range(0, len(todo), ecfg.batch_size):
        chunk = todo[start : start + ecfg.batch_size]
        src = pad([ids[i] for i in chunk]).to(device)
        if beam == 1:
            hyps = greedy(model, src, ecfg.max_len_a, ecfg.max_len_b)
        else:
            hyps = beam_search(model, src, beam, ecfg.alpha, ecfg.max_len_a, ecfg.max_len_b)
        for i, text in zip(chunk, decode(tok, hyps), strict=True):
            out[i] = text
    model.train(was_training)
    return out


def bleu_score(hyps: list[str], refs: list[str], pretokenized: bool = False) -> tuple[float, str]:
    """Corpus BLEU (sacreBLEU defaults: 13a tokenisation, exp smoothing) and its signature.

    ``pretokenized`` silences sacreBLEU's warning for text that is tokenised by construction
    (the synthetic corpus); the score and signature are unchanged."""
    metric = BLEU(force=pretokenized)
    score = metric.corpus_score(hyps, [refs])
    return score.score, str(metric.get_signature())


def _bucket_name(lo: int, hi: int | None) -> str:
    return f"{lo}-{hi}" if hi is not None else f"{lo}+"


def evaluate(model: Transformer, tok: Tokenizer, splits: Splits, ecfg: EvalConfig) -> dict[str, Any]:
    """All figures of a model on the test, extrapolation and probe sets."""
    test_src = [s for s, _ in splits.test]
    test_ref = [t for _, t in splits.test]
    long_src = [s for s, _ in splits.long]
    long_ref = [t for _, t in splits.long]
    probe_src = [s for s, _ in splits.probe]
    probe_ref = [t for _, t in splits.probe]
    hyps = translate(model, tok, test_src + long_src + probe_src, ecfg)
    test_hyp = hyps[: len(test_src)]
    long_hyp = hyps[len(test_src) : len(test_src) + len(long_src)]
    probe_hyp = hyps[len(test_src) + len(long_src) :]

    def text(h: list[str | None]) -> list[str]:
        return [x if x is not None else "" for x in h]

    bleu, signature = bleu_score(text(test_hyp), test_ref, splits.pretokenized)
    chrf = CHRF().corpus_score(text(test_hyp), [test_ref]).score
    exact = sum(h == r for h, r in zip(test_hyp, test_ref, strict=True)) / max(1, len(test_ref))
    correct = [h == r for h, r in zip(probe_hyp, probe_ref, strict=True)]
    pairs_right = sum(correct[i] and correct[i + 1] for i in range(0, len(correct), 2))
    probe = pairs_right / (len(correct) // 2) if correct else None  # None: the corpus has no probes

    buckets: dict[str, Any] = {}
    edges = sorted(ecfg.length_buckets)
    all_src, all_hyp, all_ref = (
        test_src + long_src,
        test_hyp + long_hyp,
        test_ref + long_ref,
    )
    lows = [1] + [e + 1 for e in edges]
    highs: list[int | None] = [*edges, None]
    for lo, hi in zip(lows, highs, strict=True):
        members = [
            i for i, s in enumerate(all_src) if lo <= len(s.split()) and (hi is None or len(s.split()) <= hi)
        ]
        if not members:
            continue
        unrepresentable = sum(all_hyp[i] is None for i in members)
        entry: dict[str, Any] = {"sentences": len(members)}
        if unrepresentable == len(members):
            entry["bleu"] = None
            entry["note"] = "longer than the encoder's position encoding can represent"
        else:
            kept = [i for i in members if all_hyp[i] is not None]
            hyp_k, ref_k = text([all_hyp[i] for i in kept]), [all_ref[i] for i in kept]
            entry["bleu"] = bleu_score(hyp_k, ref_k, splits.pretokenized)[0]
            if unrepresentable:
                entry["unrepresentable"] = unrepresentable
        buckets[_bucket_name(lo, hi)] = entry
    return {
        "bleu": bleu,
        "bleu_signature": signature,
        "chrf": chrf,
        "exact_match": exact,
        "probe_accuracy": probe,
        "probe_pairs": len(correct) // 2,
        "test_sentences": len(test_src),
        "bleu_by_length": buckets,
    }


def format_table(metrics: dict[str, Any]) -> str:
    """A short human-readable table of the figures."""
    rows = [
        ("BLEU (test)", f"{metrics['bleu']:.2f}"),
        ("chrF (test)", f"{metrics['chrf']:.2f}"),
        ("exact match (test)", f"{100 * metrics['exact_match']:.1f}%"),
        (
            "word-order probe accuracy",
            "n/a (no probes in this corpus)"
            if metrics["probe_accuracy"] is None
            else f"{100 * metrics['probe_accuracy']:.1f}% of {metrics['probe_pairs']} pairs",
        ),
    ]
    for name, entry in metrics["bleu_by_length"].items():
        value = "n/a (too long)" if entry["bleu"] is None else f"{entry['bleu']:.2f}"
        rows.append((f"BLEU, source {name} words", f"{value}  ({entry['sentences']} sent.)"))
    width = max(len(r[0]) for r in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines.append(f"sacreBLEU signature: {metrics['bleu_signature']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``tpe-eval``: score a checkpoint on its corpus's test, extrapolation and probe sets."""
    from tpe_train.checkpoint import load_export

    parser = argparse.ArgumentParser(prog="tpe-eval", description=__doc__)
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="checkpoint directory (<run_dir>/checkpoint)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--beam", type=int, default=None, help="override eval.beam (1: greedy)")
    args = parser.parse_args(argv)
    try:
        model, cfg, tok = load_export(args.checkpoint)
    except (FileNotFoundError, ValueError, ConfigError) as err:
        print(f"tpe-eval: {err}", file=sys.stderr)
        return 2
    if args.beam is not None:
        if args.beam < 1:
            print("tpe-eval: --beam must be at least 1", file=sys.stderr)
            return 2
        cfg.eval.beam = args.beam
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    metrics = evaluate(model, tok, test_splits(cfg.data), cfg.eval)
    print(json.dumps(metrics) if args.json else format_table(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
