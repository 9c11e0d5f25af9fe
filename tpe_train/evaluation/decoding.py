"""Decoding sentences with a model, in input order: tokenise, sort by length, cut batches of at most
``max_tokens`` padded source tokens (and ``batch_size`` sentences), beam search (or greedy), detokenise.

One function, ``decode_sentences``, serves evaluation (``tpe-eval``, training's final evaluation, the
study), validation BLEU and ``tpe-translate``: the same sentences with the same options give the same
batches, so the same translations, whichever of them asks. Empty lines are not decoded (they translate
to empty lines); a source longer than the encoder's position encoding can represent is left
untranslated (``None``), or cut to what it can represent with ``truncate``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch
from tokenizers import Tokenizer

from tpe_train.data.batching import EOS_ID, pad
from tpe_train.data.tokenizer import decode, encode
from tpe_train.model.ensemble import Ensemble
from tpe_train.model.generate import beam_search_nbest, greedy
from tpe_train.model.kernels import packed_inference
from tpe_train.model.transformer import Transformer

if TYPE_CHECKING:
    from tpe_train.config import EvalConfig


class InputError(ValueError):
    """Bad text input, with a message naming the file, the line and the fix."""


class SourceTooLong(InputError):
    """A source of more tokens than ``DecodeOptions.max_source_len``, met before anything was decoded;
    ``index`` is its place among the sentences given."""

    def __init__(self, index: int, tokens: int, limit: int, at_least: bool = False) -> None:
        self.index, self.tokens, self.limit, self.at_least = index, tokens, limit, at_least
        super().__init__(
            f"sentence {index + 1} has {'at least ' if at_least else ''}{tokens} subword tokens, more than "
            f"the limit of {limit}; raise the limit (decoding memory grows with it), or truncate to "
            f"translate its first {limit} tokens"
        )


def encode_capped(tok: Tokenizer, texts: list[str], cap: int) -> tuple[list[list[int]], set[int]]:
    """Token ids of each text (no special tokens); with ``cap`` > 0, a text long enough to hold more
    than ``cap`` tokens for certain is encoded in its head only: ``4 x cap x`` the longest token's
    characters (a token covers at most that many; NFKC joins at most three characters into one), which
    holds more than ``cap`` tokens, the same first ``cap`` as the whole line. A line of any length so
    costs time and memory in proportion to the cap, not to its length. Also returned: the indices of
    the texts cut (their token count is a lower bound)."""
    if not cap:
        return encode(tok, texts), set()
    head = 4 * cap * max((len(piece) for piece in tok.get_vocab()), default=1)
    cut = {i for i, text in enumerate(texts) if len(text) > head}
    return encode(tok, [text[:head] if i in cut else text for i, text in enumerate(texts)]), cut


def utf8_lines(stream: IO[bytes], name: str) -> Iterator[str]:
    """The lines of a byte stream as text, without their line ends; bytes that are not UTF-8 stop
    with an ``InputError`` naming ``name`` and the line."""
    for number, raw in enumerate(stream, start=1):
        raw = raw[:-1] if raw.endswith(b"\n") else raw
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise InputError(
                f"{name} line {number} is not UTF-8 (byte {raw[err.start]:#04x} at byte {err.start + 1} of "
                "the line); convert the input to UTF-8, e.g. iconv -f latin1 -t utf-8"
            ) from None


def read_lines(path: str | Path) -> list[str]:
    """Every line of a UTF-8 text file (``InputError`` for a missing file or bytes that are not UTF-8)."""
    try:
        with open(path, "rb") as f:
            return list(utf8_lines(f, str(path)))
    except OSError as err:
        raise InputError(f"cannot read {path}: {err.strerror}") from None


def device_from_arg(name: str) -> torch.device:
    """``auto`` (the GPU if torch sees one, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``; a
    ``ValueError`` for a device this process cannot use."""
    from tpe_train.parallel.context import local_device

    try:
        device = local_device() if name == "auto" else torch.device(name)
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise RuntimeError(f"torch sees {torch.cuda.device_count()} GPU(s) here")
    except RuntimeError as err:
        raise ValueError(f"--device {name}: {err}; use auto, cpu, cuda or cuda:N") from None
    return device


@dataclass(frozen=True)
class DecodeOptions:
    """How to decode; ``DecodeOptions.of(cfg.eval)`` takes a config's (the defaults live there)."""

    beam: int  # 1: greedy
    alpha: float  # length penalty exponent, ((5 + len) / 6) ** alpha
    max_len_a: float  # at most a * source tokens + b output tokens
    max_len_b: int
    max_tokens: int  # padded source tokens (EOS included) per batch
    batch_size: int  # sentences per batch at most
    nbest: int = 0  # > 0: also the n best hypotheses of each sentence with their scores
    truncate: bool = False  # cut over-long sources to what the encoder can represent (and max_source_len)
    max_source_len: int = 0  # > 0: a longer source is an error (SourceTooLong) or, with truncate, cut
    pieces: bool = False  # output the subword pieces, space-separated, instead of detokenised text

    @classmethod
    def of(cls, ecfg: EvalConfig, **changes: Any) -> DecodeOptions:
        """The options of an ``eval`` config section, with ``changes`` (e.g. ``beam=1``)."""
        base = cls(ecfg.beam, ecfg.alpha, ecfg.max_len_a, ecfg.max_len_b, ecfg.max_tokens, ecfg.batch_size)
        return replace(base, **changes)

    def check(self) -> None:
        """``ValueError`` naming the option for anything that cannot decode."""
        for name in ("beam", "max_tokens", "batch_size", "max_len_b"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.max_source_len < 0:
            raise ValueError(f"max-source-len must be at least 1 (0: no limit), got {self.max_source_len}")
        if self.nbest > self.beam:
            raise ValueError(
                f"--nbest {self.nbest} asks for more hypotheses than the beam keeps ({self.beam}); "
                f"raise --beam to at least {self.nbest}"
            )
        if self.alpha < 0 or self.max_len_a < 0:
            raise ValueError("the length penalty and max-len-a must not be negative")


@dataclass
class Translation:
    """One sentence's result. ``text`` is ``None`` when the source is longer than the encoder can
    represent and was not truncated; ``nbest`` holds (score, text), best first, when asked for."""

    text: str | None
    source_tokens: int  # subword tokens of the source, EOS excluded, before any truncation
    output_tokens: int = 0  # subword tokens of the best hypothesis, EOS excluded
    truncated: bool = False
    nbest: list[tuple[float, str]] = field(default_factory=list)


def token_batches(lengths: list[int], max_tokens: int, batch_size: int) -> list[list[int]]:
    """Indices sorted by length (ties in input order) and cut into batches whose padded size
    (longest x count) stays within ``max_tokens`` and whose count within ``batch_size``; a sentence
    longer than ``max_tokens`` on its own is a batch of one."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:  # ascending: the newest member is the longest
        if current and (len(current) >= batch_size or lengths[i] * (len(current) + 1) > max_tokens):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def decode_sentences(
    model: Transformer | Ensemble,
    tok: Tokenizer,
    sources: list[str],
    options: DecodeOptions,
    on_batch: Callable[[int], None] | None = None,
) -> list[Translation]:
    """Translations of ``sources`` in their order (see the module's docstring); ``on_batch`` is told
    how many sentences each decoded batch held. A source longer than ``options.max_source_len`` raises
    ``SourceTooLong`` before any sentence is decoded (with ``truncate``: is cut to it)."""
    cap = options.max_source_len
    ids, cut = encode_capped(tok, sources, cap)
    limit = model.max_source_length()  # positions the encoder can represent (EOS included), or None
    out = [Translation(None, len(seq)) for seq in ids]
    todo: list[int] = []
    seqs: dict[int, list[int]] = {}
    for i, (text, seq) in enumerate(zip(sources, ids, strict=True)):
        if not text.strip():
            out[i].text = ""  # an empty line translates to an empty line
            continue
        if cap and len(seq) > cap:
            if not options.truncate:
                raise SourceTooLong(i, len(seq), cap, at_least=i in cut)
            seq, out[i].truncated = seq[:cap], True
        if limit is not None and len(seq) + 1 > limit:
            if not options.truncate:
                continue  # text None: reported by the caller
            seq, out[i].truncated = seq[: limit - 1], True
        seqs[i] = [*seq, EOS_ID]
        todo.append(i)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    batches = token_batches([len(seqs[i]) for i in todo], options.max_tokens, options.batch_size)
    with packed_inference():  # the weights are packed once for all batches
        for batch in batches:
            chunk = [todo[j] for j in batch]
            src = pad([seqs[i] for i in chunk]).to(device)
            _decode_batch(model, tok, src, [out[i] for i in chunk], options)
            if on_batch is not None:
                on_batch(len(chunk))
    model.train(was_training)
    return out


def _decode_batch(
    model: Transformer | Ensemble,
    tok: Tokenizer,
    src: torch.Tensor,
    results: list[Translation],
    options: DecodeOptions,
) -> None:
    """Fill ``results`` (one per row of ``src``) with the best hypothesis (and the n best)."""
    o = options

    def render(hyps: list[list[int]]) -> list[str]:
        if o.pieces:
            return [" ".join(tok.id_to_token(i) or "" for i in hyp) for hyp in hyps]
        return decode(tok, hyps)

    if o.beam == 1 and not o.nbest:
        best = greedy(model, src, o.max_len_a, o.max_len_b)
    else:
        found = beam_search_nbest(model, src, o.beam, o.alpha, o.max_len_a, o.max_len_b)
        best = [hyps[0][1] for hyps in found]
        for result, hyps in zip(results, found, strict=True) if o.nbest else ():
            kept = hyps[: o.nbest]
            result.nbest = list(zip([s for s, _ in kept], render([h for _, h in kept]), strict=True))
    for result, hyp, text in zip(results, best, render(best), strict=True):
        result.text, result.output_tokens = text, len(hyp)
