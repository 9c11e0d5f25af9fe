"""Evaluate a model on a list of test sets, keep what was scored, compare two models.

``evaluate`` is the one evaluation: training's final evaluation, ``tpe-eval`` and the study call it. It
decodes every test set (``decoding.decode_sentences``) and scores it (``metrics``): sacreBLEU (with
signature), chrF, exact match, word-order probe accuracy (synthetic corpus), BLEU by source-length
bucket (over the test set and, synthetic, sentences longer than any in training), and on real corpora
the papers' tokenized BLEU (compound-split, cased) and the Multi30k literature's (lowercased).
``EvalFiles`` names what evaluation keeps on disk: the figures and every set's hypotheses, so that
significance tests pair runs without decoding again.

    tpe-eval --checkpoint DIR                                  # the config's test split: table
    tpe-eval --checkpoint DIR --split test_2016_flickr,test_2017_flickr --json
    tpe-eval --checkpoint DIR --src newstest2014.en --ref newstest2014.de
    tpe-eval --checkpoint A --compare B                        # paired bootstrap, BLEU and chrF
    tpe-eval --checkpoint A B --compare A                      # the ensemble of A and B against A
    tpe-eval --checkpoint DIR --limit 100                      # a quick look: the first 100 pairs
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from tpe_train.ckpt.rundir import EVAL
from tpe_train.config import DataConfig, EvalConfig
from tpe_train.data.sources import CorpusError, load_split
from tpe_train.data.specs import corpus_spec, source_spec
from tpe_train.data.splits import Splits, pairs_of, synthetic_splits, test_splits
from tpe_train.data.synthetic import Pair
from tpe_train.evaluation import metrics
from tpe_train.evaluation.decoding import (
    DecodeOptions,
    InputError,
    decode_sentences,
    read_lines,
)
from tpe_train.evaluation.figures import read_figures
from tpe_train.model.ensemble import Ensemble
from tpe_train.model.transformer import Transformer
from tpe_train.run.outputs import record


@dataclass
class TestSet:
    """Pairs to score under one name. ``long`` (sentences longer than any in training) and ``probe``
    (word-order minimal pairs as rows 2i, 2i+1) accompany the synthetic corpus's test split."""

    name: str
    pairs: list[Pair]
    long: list[Pair] = field(default_factory=list)
    probe: list[Pair] = field(default_factory=list)
    pretokenized: bool = False  # text is split into words already (the synthetic corpus)


def config_sets(cfg: DataConfig, splits: Splits | None = None) -> list[TestSet]:
    """The config's test split (``data.test_split``), from ``splits`` when the corpus is loaded."""
    s = splits if splits is not None else test_splits(corpus_spec(cfg))
    return [TestSet(cfg.test_split, s.test, s.long, s.probe, s.pretokenized)]


def corpus_sets(cfg: DataConfig, names: Sequence[str]) -> list[TestSet]:
    """Named splits of the config's corpus, each a test set (``CorpusError`` for a missing one)."""
    if cfg.corpus != "synthetic":
        return [TestSet(name, pairs_of(load_split(source_spec(cfg), name))) for name in names]
    splits = synthetic_splits(cfg.synthetic)
    known = {cfg.train_split: splits.train, cfg.valid_split: splits.valid}
    sets = []
    for name in names:
        if name == cfg.test_split:
            sets += config_sets(cfg, splits)
        elif name in known:
            sets.append(TestSet(name, pairs_of(known[name]), pretokenized=True))
        else:
            choices = ", ".join([cfg.test_split, *known])
            raise CorpusError(f"the synthetic corpus has no split {name!r}; its splits are {choices}")
    return sets


def file_set(src: str | Path, ref: str | Path) -> TestSet:
    """A source and a reference file, line by line, as a test set named after the source file."""
    sources, refs = read_lines(src), read_lines(ref)
    if len(sources) != len(refs):
        raise InputError(
            f"{src} has {len(sources)} lines but {ref} has {len(refs)}; --src and --ref must be "
            "line-aligned (one segment per line)"
        )
    return TestSet(Path(src).name, list(zip(sources, refs, strict=True)))


def concatenated(test: TestSet, n: int) -> TestSet:
    """``test`` as segments of ``n`` consecutive pairs, in order and without overlap: the sources
    joined by a space, the references the same way (real text at n times the lengths; the name says
    ``+xN``). A last group of fewer than ``n`` pairs is left out, so every segment holds ``n``. The
    synthetic corpus's long sentences and word-order probe do not carry over."""
    if n < 2:
        raise ValueError(f"--concat {n}: concatenate at least 2 sentences (1 is the set itself)")
    groups = [test.pairs[i : i + n] for i in range(0, len(test.pairs) - n + 1, n)]
    pairs = [(" ".join(s for s, _ in g), " ".join(r for _, r in g)) for g in groups]
    return TestSet(f"{test.name}+x{n}", pairs, pretokenized=test.pretokenized)


# --------------------------------------------------------------------------------------------------
# Scoring


@dataclass
class SetResult:
    """One test set's figures and what they were computed from."""

    name: str
    figures: dict[str, Any]
    hypotheses: list[str]  # one per test pair; '' where the encoder could not represent the source
    references: list[str]
    untranslated: list[int] = field(default_factory=list)  # those pairs' indices (scored as '')


@dataclass
class Evaluation:
    """Every test set's result, in the order asked for."""

    sets: list[SetResult]

    def figures(self) -> dict[str, Any]:
        """The JSON of an evaluation: the first set's figures at the top level (the config's test split
        when nothing else is asked for), and every set's under ``sets``."""
        return {**self.sets[0].figures, "sets": {r.name: r.figures for r in self.sets}}


def evaluate(
    model: Transformer | Ensemble,
    tok: Tokenizer,
    sets: list[TestSet],
    ecfg: EvalConfig,
    lang: str | None = None,
) -> Evaluation:
    """Decode (``ecfg``'s beam, lengths and batches) and score every set. With ``lang`` (the target
    language) and real text, also the papers' tokenized BLEU and the lowercased Multi30k BLEU."""
    options = DecodeOptions.of(ecfg)
    return Evaluation([_score_set(model, tok, s, options, ecfg.length_buckets, lang) for s in sets])


def _score_set(
    model: Transformer | Ensemble,
    tok: Tokenizer,
    test: TestSet,
    options: DecodeOptions,
    edges: list[int],
    lang: str | None,
) -> SetResult:
    def hyps(pairs: list[Pair]) -> list[str | None]:  # each set on its own: the batches tpe-translate cuts
        return [t.text for t in decode_sentences(model, tok, [s for s, _ in pairs], options)]

    test_hyp, long_hyp, probe_hyp = hyps(test.pairs), hyps(test.long), hyps(test.probe)
    test_ref = [t for _, t in test.pairs]
    text = [h if h is not None else "" for h in test_hyp]
    bleu, signature = metrics.bleu(text, test_ref, test.pretokenized)
    correct = [h == r for h, (_, r) in zip(probe_hyp, test.probe, strict=True)]
    pairs_right = sum(correct[i] and correct[i + 1] for i in range(0, len(correct), 2))
    figures: dict[str, Any] = {
        "test_set": test.name,
        "bleu": bleu,
        "bleu_signature": signature,
        "chrf": metrics.chrf(text, test_ref),
        "exact_match": sum(h == r for h, r in zip(test_hyp, test_ref, strict=True)) / max(1, len(test_ref)),
        "probe_accuracy": pairs_right / (len(correct) // 2) if correct else None,  # None: no probes
        "probe_pairs": len(correct) // 2,
        "test_sentences": len(test_ref),
        "bleu_by_length": _buckets(
            [*test.pairs, *test.long], [*test_hyp, *long_hyp], edges, test.pretokenized
        ),
    }
    too_long = sum(h is None for h in test_hyp)
    if too_long:
        figures["too_long"] = too_long  # scored as empty translations
    if lang is not None and not test.pretokenized:  # the synthetic corpus is tokenized already
        for key, score in (
            ("bleu_tokenized", metrics.tokenized_bleu),  # cased, compound-split (WMT En-De papers)
            ("bleu_lc_tokenized", metrics.lc_tokenized_bleu),  # lowercased (the Multi30k literature)
        ):
            figures[key], figures[f"{key}_method"] = score(text, test_ref, lang)
    untranslated = [i for i, h in enumerate(test_hyp) if h is None]
    return SetResult(test.name, figures, text, test_ref, untranslated)


def length_bucket(words: int, edges: list[int]) -> str:
    """The name of the length bucket of a source of ``words`` words: ``1-8``, ``9-16``, ..., ``33+``
    for sorted ``edges`` 8, 16, 24, 32."""
    lo = 1
    for edge in edges:
        if words <= edge:
            return f"{lo}-{edge}"
        lo = edge + 1
    return f"{lo}+"


def _buckets(
    pairs: list[Pair], hyps: list[str | None], edges: list[int], pretokenized: bool
) -> dict[str, Any]:
    """BLEU by source length in words: buckets up to each edge, then an open one."""
    buckets: dict[str, Any] = {}
    lows = [1] + [e + 1 for e in sorted(edges)]
    highs: list[int | None] = [*sorted(edges), None]
    words = [len(s.split()) for s, _ in pairs]
    for lo, hi in zip(lows, highs, strict=True):
        members = [i for i, n in enumerate(words) if lo <= n and (hi is None or n <= hi)]
        if not members:
            continue
        name = length_bucket(lo, sorted(edges))
        kept = [i for i in members if hyps[i] is not None]
        entry: dict[str, Any] = {"sentences": len(members)}
        if not kept:
            entry["bleu"] = None
            entry["note"] = "longer than the encoder's position encoding can represent"
        else:
            hyp_k = [hyps[i] or "" for i in kept]
            entry["bleu"] = metrics.bleu(hyp_k, [pairs[i][1] for i in kept], pretokenized)[0]
            if len(kept) < len(members):
                entry["unrepresentable"] = len(members) - len(kept)
        buckets[name] = entry
    return buckets


# --------------------------------------------------------------------------------------------------
# On disk


class EvalFiles:
    """What evaluation keeps in a directory (a run directory, or an averaged export): the figures
    (``eval.json``) and, per test set, the hypotheses that were scored and their references, one
    sentence a line in test-set order (``hypotheses/<set>.hyp``, ``hypotheses/<set>.ref``). The only
    place these names are spelled."""

    FIGURES = EVAL
    HYPOTHESES = "hypotheses"

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    @property
    def figures(self) -> Path:
        return self.directory / self.FIGURES

    def _file(self, name: str, suffix: str) -> Path:
        return self.directory / self.HYPOTHESES / (re.sub(r"[^\w.+-]", "_", name) + suffix)

    def hypotheses(self, name: str) -> Path:
        return self._file(name, ".hyp")

    def references(self, name: str) -> Path:
        return self._file(name, ".ref")

    def write(self, evaluation: Evaluation, figures: dict[str, Any] | None = None) -> Path:
        """Every set's hypotheses and references, then the figures (``evaluation``'s, or ``figures``
        where the caller adds to them); each file replaced atomically, the figures last."""
        for result in evaluation.sets:
            _write(self.hypotheses(result.name), result.hypotheses)
            _write(self.references(result.name), result.references)
        path = self.figures
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(figures if figures is not None else evaluation.figures(), indent=2))
        tmp.replace(path)
        written = [path, *(f(r.name) for r in evaluation.sets for f in (self.hypotheses, self.references))]
        # in an export (an output with a marker): a later export replacing it may remove these too
        record(self.directory, [p.relative_to(self.directory).as_posix() for p in written], "tpe-eval")
        return path

    def read_figures(self) -> dict[str, Any] | None:
        """The checked figures (``figures.read_figures``), or None where there are none yet."""
        if not (self.figures.is_file() or self.figures.is_symlink()):
            return None
        return read_figures(self.directory, self.FIGURES)

    def read_set(self, name: str) -> tuple[list[str], list[str]] | None:
        """(hypotheses, references) of a set, or None when this evaluation did not keep them."""
        hyp, ref = self.hypotheses(name), self.references(name)
        if not (hyp.is_file() and ref.is_file()):
            return None
        return read_lines(hyp), read_lines(ref)


def _write(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(line.replace("\n", " ") + "\n" for line in lines), encoding="utf-8")
    tmp.replace(path)


# --------------------------------------------------------------------------------------------------
# Tables


def format_table(figures: dict[str, Any], name: str = "test") -> str:
    """A short human-readable table of the figures of one set, ``name``."""
    rows = [
        (f"BLEU ({name})", f"{figures['bleu']:.2f}"),
        (f"chrF ({name})", f"{figures['chrf']:.2f}"),
        (f"exact match ({name})", f"{100 * figures['exact_match']:.1f}%"),
        (
            "word-order probe accuracy",
            "n/a (no probes in this corpus)"
            if figures["probe_accuracy"] is None
            else f"{100 * figures['probe_accuracy']:.1f}% of {figures['probe_pairs']} pairs",
        ),
    ]
    for key in ("bleu_tokenized", "bleu_lc_tokenized"):
        if figures.get(key) is not None:
            rows.append((f"BLEU ({figures[key + '_method']})", f"{figures[key]:.2f}"))
    if figures.get("too_long"):
        rows.append(("too long to translate (scored empty)", str(figures["too_long"])))
    for name, entry in figures["bleu_by_length"].items():
        value = "n/a (too long)" if entry["bleu"] is None else f"{entry['bleu']:.2f}"
        rows.append((f"BLEU, source {name} words", f"{value}  ({entry['sentences']} sent.)"))
    width = max(len(r[0]) for r in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines.append(f"sacreBLEU signature: {figures['bleu_signature']}")
    return "\n".join(lines)


def format_evaluation(evaluation: Evaluation) -> str:
    """One table per set (a heading per set when there are several)."""
    if len(evaluation.sets) == 1:
        only = evaluation.sets[0]
        return format_table(only.figures, only.name)
    return "\n\n".join(
        f"== {r.name} ({r.figures['test_sentences']} sentences)\n{format_table(r.figures, r.name)}"
        for r in evaluation.sets
    )


def compare(system: Evaluation, baseline: Evaluation, samples: int = 1000) -> dict[str, metrics.PairedResult]:
    """Per set, the paired bootstrap test of ``system``'s hypotheses against ``baseline``'s."""
    out = {}
    for s, b in zip(system.sets, baseline.sets, strict=True):
        assert s.name == b.name and s.references == b.references
        out[s.name] = metrics.paired_bootstrap(s.hypotheses, b.hypotheses, s.references, samples)
    return out


def format_comparison(tests: dict[str, metrics.PairedResult], system: str, baseline: str) -> str:
    """Per set: both scores (bootstrap mean ± 95% half-width), the difference and its p-value."""
    blocks = [f"system: {system}\nbaseline: {baseline}"]
    for name, result in tests.items():
        lines = [
            f"== {name} ({result.sentences} sentences; paired bootstrap resampling, "
            f"{result.samples} resamples)",
            f"{'':6}{'system':>24}{'baseline':>24}{'difference':>12}{'p':>8}",
        ]
        for key, label in (("bleu", "BLEU"), ("chrf", "chrF")):
            m = result.metrics[key]
            sys_ = f"{m.system:.2f} ({m.system_mean:.2f} ± {m.system_ci:.2f})"
            base = f"{m.baseline:.2f} ({m.baseline_mean:.2f} ± {m.baseline_ci:.2f})"
            lines.append(f"{label:<6}{sys_:>24}{base:>24}{m.delta:>+12.2f}{m.p_value:>8.4f}")
        lines.append(f"sacreBLEU: {result.signatures['bleu']}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
