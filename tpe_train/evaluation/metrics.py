"""Scoring only: sacreBLEU (with its signature), chrF, the papers' tokenized BLEU (Moses tokenizer port,
compound splitting, multi-bleu; also lowercased as the Multi30k literature scores), and sacreBLEU's
paired bootstrap resampling between two systems. Nothing here decodes or reads a model."""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.significance import PairedTest


def bleu(hyps: Sequence[str], refs: Sequence[str], pretokenized: bool = False) -> tuple[float, str]:
    """Corpus BLEU (sacreBLEU defaults: 13a tokenisation, exp smoothing) and its signature.

    ``pretokenized`` silences sacreBLEU's warning for text that is tokenised by construction
    (the synthetic corpus); the score and signature are unchanged."""
    metric = BLEU(force=pretokenized)
    score = metric.corpus_score(list(hyps), [list(refs)])
    return score.score, str(metric.get_signature())


def length_ratio(hyps: Sequence[str], refs: Sequence[str]) -> float:
    """Hypothesis over reference length in sacreBLEU's 13a tokens (BLEU's ``sys_len / ref_len``, what
    its brevity penalty reads): below 1, the translations are shorter than the references."""
    score = BLEU().corpus_score(list(hyps), [list(refs)])
    return score.sys_len / max(score.ref_len, 1)


def chrf(hyps: Sequence[str], refs: Sequence[str]) -> float:
    """Corpus chrF (sacreBLEU defaults: character 6-grams, beta 2)."""
    return CHRF().corpus_score(list(hyps), [list(refs)]).score


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
    hyps: Sequence[str],
    refs: Sequence[str],
    lang: str,
    split_compounds: bool | None = None,
    lowercase: bool = False,
) -> tuple[float, str]:
    """The papers' BLEU and a description of how it was computed: both sides Moses-tokenized for
    ``lang``, compounds split (default: German targets, as get_ende_bleu.sh), then multi-bleu.perl's
    corpus BLEU on whitespace tokens (no smoothing; case-sensitive, or ``multi-bleu.perl -lc`` with
    ``lowercase``)."""
    split = lang == "de" if split_compounds is None else split_compounds

    def prepare(lines: Sequence[str]) -> list[str]:
        out = [moses_tokenize(line, lang) for line in lines]
        return [compound_split(line) for line in out] if split else out

    metric = BLEU(tokenize="none", smooth_method="none", lowercase=lowercase, force=True)
    score = metric.corpus_score(prepare(hyps), [prepare(refs)]).score
    method = f"moses-tok:{lang}" + ("+compound-split" if split else "") + "|multi-bleu"
    method += " -lc" if lowercase else ""
    return score, method


def lc_tokenized_bleu(hyps: Sequence[str], refs: Sequence[str], lang: str) -> tuple[float, str]:
    """BLEU as the Multi30k literature usually reports it: both sides Moses-tokenized (no compound
    splitting), lowercased, ``multi-bleu.perl -lc``. Not comparable to cased sacreBLEU, nor to the
    cased compound-split WMT figure."""
    return tokenized_bleu(hyps, refs, lang, split_compounds=False, lowercase=True)


# --- Paired significance: sacreBLEU's paired bootstrap resampling -------------------------------------
#: The figures a paired test covers: result key -> sacreBLEU's name of the metric.
PAIRED_METRICS = {"bleu": "BLEU", "chrf": "chrF2"}


@dataclass(frozen=True)
class Paired:
    """One metric of a paired test of ``system`` against ``baseline`` on the same sentences: both
    scores, the bootstrap mean and 95% confidence half-width of each, and the p-value of the
    difference (the probability of a difference at least this large by chance)."""

    system: float
    system_mean: float
    system_ci: float
    baseline: float
    baseline_mean: float
    baseline_ci: float
    p_value: float

    @property
    def delta(self) -> float:
        return self.system - self.baseline

    def as_dict(self) -> dict[str, float]:
        return {
            "system": self.system,
            "system_mean": self.system_mean,
            "system_ci95": self.system_ci,
            "baseline": self.baseline,
            "baseline_mean": self.baseline_mean,
            "baseline_ci95": self.baseline_ci,
            "delta": self.delta,
            "p_value": self.p_value,
        }


@dataclass(frozen=True)
class PairedResult:
    """A paired bootstrap test of two systems' hypotheses of the same references: BLEU and chrF."""

    metrics: dict[str, Paired]  # "bleu", "chrf"
    signatures: dict[str, str]  # sacreBLEU's signature of each test (bs: resamples, seed, metric)
    sentences: int
    samples: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "test": "paired bootstrap resampling (sacreBLEU)",
            "sentences": self.sentences,
            "samples": self.samples,
            "signatures": self.signatures,
            **{key: paired.as_dict() for key, paired in self.metrics.items()},
        }


def paired_bootstrap(
    system: Sequence[str], baseline: Sequence[str], refs: Sequence[str], samples: int = 1000
) -> PairedResult:
    """sacreBLEU's paired bootstrap resampling (Koehn 2004, as Moses'
    bootstrap-hypothesis-difference-significance.pl) of ``system`` against ``baseline``, BLEU and chrF,
    with sacreBLEU's fixed seed (``SACREBLEU_SEED``, default 12345): the same inputs give the same
    p-values.

    One correction: sacreBLEU counts the resamples whose centred difference is *strictly* larger than the
    observed one. When every resample gives both systems the same score (identical hypotheses, or a BLEU
    of 0 on both sides throughout) all of them tie with an observed difference of 0 and sacreBLEU returns
    p = 1 / (samples + 1), "significant". An observed difference of exactly 0 is no evidence of a
    difference: its p-value is 1 here."""
    if not len(system) == len(baseline) == len(refs):
        raise ValueError(
            f"a paired test needs one hypothesis of each system per reference: {len(system)} system, "
            f"{len(baseline)} baseline hypotheses, {len(refs)} references"
        )
    if not refs:
        raise ValueError("a paired test needs at least one sentence")
    metrics = {"BLEU": BLEU(force=True), "chrF2": CHRF()}
    test = PairedTest(
        [("baseline", list(baseline)), ("system", list(system))],
        metrics,
        [list(refs)],
        test_type="bs",
        n_samples=samples,
    )
    signatures, scores = test()
    out: dict[str, Paired] = {}
    for key, name in PAIRED_METRICS.items():
        base, sys_ = scores[name]
        assert not isinstance(base, str) and not isinstance(sys_, str)
        values = (sys_.mean, sys_.ci, base.mean, base.ci, sys_.p_value)
        assert all(v is not None for v in values), values  # a bootstrap test fills them all
        s_mean, s_ci, b_mean, b_ci, p = (float(v or 0.0) for v in values)
        tie = float(sys_.score) == float(base.score)
        out[key] = Paired(float(sys_.score), s_mean, s_ci, float(base.score), b_mean, b_ci, 1.0 if tie else p)
    return PairedResult(out, {k: str(signatures[n]) for k, n in PAIRED_METRICS.items()}, len(refs), samples)
