"""Translate and score: sacreBLEU (with signature), chrF, exact match, word-order probe accuracy,
BLEU by source-length bucket, and the papers' tokenized BLEU with compound splitting (real corpora).
``tpe-eval --checkpoint DIR [--json]``."""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
import unicodedata
from collections.abc import Callable
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


# --- The papers' BLEU: Moses tokenization, compound splitting, multi-bleu.perl --------------------------
# Vaswani et al. 2017 and the works set beside it score En-De as tensor2tensor's get_ende_bleu.sh and
# fairseq's compound_split_bleu.sh do: both sides tokenized by Moses' tokenizer.perl (-l de, default
# escaping, no -a), hyphenated compounds split as "rich ##AT##-##AT## text", then multi-bleu.perl
# (case-sensitive corpus BLEU on whitespace tokens, no smoothing). Not comparable to sacreBLEU.


def _prefixes(always: str, before_numbers: str) -> dict[str, int]:
    """Single capitals (initials) and ``always`` keep their period (1); ``before_numbers`` only
    before a number (2)."""
    table = {chr(c): 1 for c in range(ord("A"), ord("Z") + 1)}
    table.update({word: 1 for word in always.split()})
    table.update({word: 2 for word in before_numbers.split()})
    return table


#: Words whose final period is not split off by the tokenizer (1), or only before a number (2). A short
#: list of common abbreviations written for this project, smaller than Moses' files: a rare abbreviation
#: followed by a capitalised word may be split where tokenizer.perl keeps it (both sides alike).
NONBREAKING: dict[str, dict[str, int]] = {
    "en": _prefixes(
        "Mr Mrs Ms Dr Prof Sr Jr St Mt Gen Gov Sen Rep Rev Capt Col Lt Sgt Inc Ltd Co vs e.g i.e "
        "Jan Feb Mar Apr Jun Jul Aug Sep Sept Oct Nov Dec",
        "No Nos Art Nr pp",
    ),
    "de": _prefixes(
        "Dr Prof Hr Fr Frl St Abt Bd bzw ca evtl ggf inkl Jh Jhd Mio Mrd usw vgl "
        "Jan Feb Mär Apr Jun Jul Aug Sep Sept Okt Nov Dez",
        "Nr Art Abs S",
    ),
    "fr": _prefixes(
        "M MM Mme Mmes Mlle Dr Pr St Ste Me Mgr etc cf janv févr avr juil sept oct nov déc",
        "No no n° art p",
    ),
}


@functools.cache
def _class(prop: str) -> str:
    """The body of a regex character class holding the code points of a Unicode property (planes 0-1):
    ``alpha`` (letters), ``alnum`` (letters and decimal digits), ``number`` (category N)."""
    tests: dict[str, Callable[[str], bool]] = {
        "alpha": str.isalpha,
        "alnum": lambda c: c.isalpha() or unicodedata.category(c) == "Nd",
        "number": lambda c: unicodedata.category(c).startswith("N"),
    }
    test, ranges, start = tests[prop], [], -1
    for cp in range(0x20001):
        inside = cp < 0x20000 and test(chr(cp))
        if inside and start < 0:
            start = cp
        elif not inside and start >= 0:
            ranges.append((start, cp - 1))
            start = -1
    return "".join(re.escape(chr(a)) + (f"-{re.escape(chr(b))}" if b > a else "") for a, b in ranges)


@functools.cache
def _moses_rules(lang: str) -> list[tuple[re.Pattern[str], str]]:
    """tokenizer.perl's substitutions up to the word loop, in its order, for ``lang``."""
    alpha, alnum, num = _class("alpha"), _class("alnum"), _class("number")
    rules = [
        (rf"([^{alnum}\s.'`,\-])", r" \1 "),  # every other special character is a token
        (r"\.(\.+)", r" DOTMULTI\1"),  # multi-dots stay together (finished below)
    ]
    rules += [
        (rf"([^{num}]),", r"\1 , "),  # commas, except inside numbers (5,300)
        (rf",([^{num}])", r" , \1"),
        (rf"([{num}]),$", r"\1 ,"),
    ]
    if lang == "en":  # contractions split to the right: don 't
        rules += [
            (rf"([^{alpha}])'([^{alpha}])", r"\1 ' \2"),
            (rf"([^{alpha}{num}])'([{alpha}])", r"\1 ' \2"),
            (rf"([{alpha}])'([^{alpha}])", r"\1 ' \2"),
            (rf"([{alpha}])'([{alpha}])", r"\1 '\2"),
            (rf"([{num}])'(s)", r"\1 '\2"),
        ]
    elif lang in ("fr", "it", "ga", "ca"):  # contractions split to the left: l' homme
        rules += [
            (rf"([^{alpha}])'([^{alpha}])", r"\1 ' \2"),
            (rf"([^{alpha}])'([{alpha}])", r"\1 ' \2"),
            (rf"([{alpha}])'([^{alpha}])", r"\1 ' \2"),
            (rf"([{alpha}])'([{alpha}])", r"\1' \2"),
        ]
    else:
        rules.append((r"'", " ' "))
    return [(re.compile(pattern), repl) for pattern, repl in rules]


_ESCAPES = [("&", "&amp;"), ("|", "&#124;"), ("<", "&lt;"), (">", "&gt;"), ("'", "&apos;"), ('"', "&quot;"),
            ("[", "&#91;"), ("]", "&#93;")]  # fmt: skip


def _keeps_period(pre: str, nxt: str, prefixes: dict[str, int]) -> bool:
    """tokenizer.perl: ``pre.`` stays one token before the word ``nxt`` when it is an abbreviation
    (holds a period and a letter, or is listed), when a lowercase word follows, or when a number follows
    a prefix listed for numbers."""
    if ("." in pre and re.search(f"[{_class('alpha')}]", pre)) or prefixes.get(pre) == 1:
        return True
    return nxt[:1].islower() or (prefixes.get(pre) == 2 and re.match("[0-9]", nxt) is not None)


def moses_tokenize(text: str, lang: str) -> str:
    """One line tokenized as Moses' ``tokenizer.perl -l LANG`` does (default escaping, no -a)."""
    text = re.sub(r"\s+", " ", f" {text} ")
    text = re.sub(r"[\x00-\x1f]", "", text).strip(" ")
    if not text:
        return ""
    rules = _moses_rules(lang)
    for pattern, repl in rules[:2]:
        text = pattern.sub(repl, text)
    while "DOTMULTI." in text:
        text = re.sub(r"DOTMULTI\.([^.])", r"DOTDOTMULTI \1", text)
        text = text.replace("DOTMULTI.", "DOTDOTMULTI")
    for pattern, repl in rules[2:]:
        text = pattern.sub(repl, text)
    prefixes = NONBREAKING.get(lang, NONBREAKING["en"])
    words = text.split(" ")
    while words and not words[-1]:  # Perl's split drops trailing empty fields
        words.pop()
    for i, word in enumerate(words):
        m = re.fullmatch(r"(\S+)\.", word)
        if m is None:
            continue
        pre = m.group(1)
        if i + 1 == len(words) or not _keeps_period(pre, words[i + 1], prefixes):
            words[i] = f"{pre} ."  # the last word is a sentence end, never an abbreviation
    text = re.sub(" +", " ", " ".join(words)).strip(" ")
    text = re.sub(r"\.' ?$", " . ' ", text, count=1)
    while "DOTDOTMULTI" in text:
        text = text.replace("DOTDOTMULTI", "DOTMULTI.")
    text = text.replace("DOTMULTI", ".")
    for char, escaped in _ESCAPES:
        text = text.replace(char, escaped)
    return text.strip(" ")


def compound_split(text: str) -> str:
    """``perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'``: rich-text -> rich ##AT##-##AT## text.
    Like the Perl, matches do not overlap: a-b-c -> a ##AT##-##AT## b-c."""
    return re.sub(r"(\S)-(\S)", r"\1 ##AT##-##AT## \2", text)


def tokenized_bleu(
    hyps: list[str], refs: list[str], lang: str, split_compounds: bool | None = None
) -> tuple[float, str]:
    """The papers' BLEU and a description of how it was computed: both sides Moses-tokenized for
    ``lang``, compounds split (default: German targets, as get_ende_bleu.sh), then multi-bleu.perl's
    corpus BLEU on whitespace tokens (case-sensitive, no smoothing)."""
    split = lang == "de" if split_compounds is None else split_compounds

    def prepare(lines: list[str]) -> list[str]:
        out = [moses_tokenize(line, lang) for line in lines]
        return [compound_split(line) for line in out] if split else out

    metric = BLEU(tokenize="none", smooth_method="none", force=True)
    score = metric.corpus_score(prepare(hyps), [prepare(refs)]).score
    method = f"moses-tok:{lang}" + ("+compound-split" if split else "") + "|multi-bleu"
    return score, method


def _bucket_name(lo: int, hi: int | None) -> str:
    return f"{lo}-{hi}" if hi is not None else f"{lo}+"


def evaluate(
    model: Transformer, tok: Tokenizer, splits: Splits, ecfg: EvalConfig, lang: str | None = None
) -> dict[str, Any]:
    """All figures of a model on the test, extrapolation and probe sets. With ``lang`` (the target
    language) and a real corpus, also the papers' tokenized BLEU (``bleu_tokenized``)."""
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
    metrics: dict[str, Any] = {
        "bleu": bleu,
        "bleu_signature": signature,
        "chrf": chrf,
        "exact_match": exact,
        "probe_accuracy": probe,
        "probe_pairs": len(correct) // 2,
        "test_sentences": len(test_src),
        "bleu_by_length": buckets,
    }
    if lang is not None and not splits.pretokenized:  # the synthetic corpus is tokenized already
        tok_bleu, method = tokenized_bleu(text(test_hyp), test_ref, lang)
        metrics["bleu_tokenized"], metrics["bleu_tokenized_method"] = tok_bleu, method
    return metrics


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
    if metrics.get("bleu_tokenized") is not None:
        rows.append(
            (f"BLEU tokenized ({metrics['bleu_tokenized_method']})", f"{metrics['bleu_tokenized']:.2f}")
        )
    for name, entry in metrics["bleu_by_length"].items():
        value = "n/a (too long)" if entry["bleu"] is None else f"{entry['bleu']:.2f}"
        rows.append((f"BLEU, source {name} words", f"{value}  ({entry['sentences']} sent.)"))
    width = max(len(r[0]) for r in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines.append(f"sacreBLEU signature: {metrics['bleu_signature']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``tpe-eval``: score a checkpoint on its corpus's test, extrapolation and probe sets."""
    from tpe_train.ckpt.export import load_export
    from tpe_train.parallel.context import local_device

    parser = argparse.ArgumentParser(prog="tpe-eval", description=__doc__)
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="checkpoint directory (<run_dir>/checkpoint)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--beam", type=int, default=None, help="override eval.beam (1: greedy)")
    parser.add_argument(
        "--device", default="auto", help="auto (the GPU if torch sees one, else the CPU), cpu, cuda or cuda:N"
    )
    args = parser.parse_args(argv)
    try:
        device = local_device() if args.device == "auto" else torch.device(args.device)
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise RuntimeError(f"torch sees {torch.cuda.device_count()} GPU(s) here")
    except RuntimeError as err:
        print(f"tpe-eval: --device {args.device}: {err}; use auto, cpu, cuda or cuda:N", file=sys.stderr)
        return 2
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
    metrics = evaluate(model.to(device), tok, test_splits(cfg.data), cfg.eval, lang=cfg.data.tgt_lang)
    print(json.dumps(metrics) if args.json else format_table(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
