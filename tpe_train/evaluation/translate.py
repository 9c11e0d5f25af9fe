"""``tpe-translate``: translate a file or stdin with an export, in input order.

    tpe-translate --checkpoint runs/demo-sinusoidal-s1/checkpoint -i test.en -o test.hyp
    echo "the small cat helps a river ." | tpe-translate --checkpoint DIR
    tpe-translate --checkpoint DIR -i test.en --nbest 4          # LINE<TAB>SCORE<TAB>TEXT, best first
    tpe-translate --checkpoint DIR -i test.en --beam 1           # greedy
    tpe-translate --checkpoint A B -i test.en                    # the ensemble of two checkpoints

Sentences are sorted by length and decoded in batches of at most ``--max-tokens`` padded source tokens
(``--buffer-lines`` lines are read, sorted and translated at a time), then written in input order,
detokenised (``--pieces``: the subword pieces). Decoding defaults are the checkpoint's ``eval`` section.
An empty line gives an empty line. Every encoding has a length cap, ``--max-source-len`` subword
tokens (default 1024): a longer line stops the command with its line number named (for a file, before
anything is translated; for stdin, before its chunk is decoded), or is cut to the cap with
``--truncate``. A sentence longer than the encoder's position encoding can represent (a learned table)
gives an empty line and is reported by line number on stderr, or is cut to what the encoder represents
with ``--truncate``. Bytes that are not UTF-8 stop the command with the line named (for a file, before
anything is translated). A file named by ``-o`` is written under a temporary name and takes its name
only when every line is translated; a stop partway (bad input, an interrupt, memory) keeps the lines
translated so far, flushed, in ``<output>.partial``, and an earlier ``<output>`` stays as it was.
Throughput is printed on stderr at the end. Exit status: 0 done, 1 out of device memory, 2 bad
input, 130 interrupted.

Several checkpoints of one vocabulary decode as an ensemble: at every step of the beam (or greedy)
search the log of the mean of their next-token probabilities; each keeps its own encoder output and
decoder cache, ``--position`` settings apply to each, and the decoding defaults are the first one's.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from tokenizers import Tokenizer

from tpe_train.evaluation.decoding import (
    DecodeOptions,
    InputError,
    SourceTooLong,
    Translation,
    decode_sentences,
)
from tpe_train.model.ensemble import Ensemble
from tpe_train.model.transformer import Transformer


@dataclass
class Tally:
    """What was translated, for the closing line on stderr."""

    sentences: int = 0
    source_tokens: int = 0
    output_tokens: int = 0
    too_long: list[int] = field(default_factory=list)  # line numbers left untranslated
    truncated: list[int] = field(default_factory=list)  # line numbers cut to the encoder's length
    seconds: float = 0.0

    def summary(self) -> list[str]:
        """The lines ``tpe-translate`` logs at the end: speed, and the lines left empty or truncated."""
        s = max(self.seconds, 1e-9)
        lines = [
            f"{self.sentences:,} sentences ({self.source_tokens:,} source, "
            f"{self.output_tokens:,} output tokens) in {self.seconds:.1f} s: {self.sentences / s:,.1f} "
            f"sentences/s, {self.output_tokens / s:,.0f} output tokens/s"
        ]
        if self.too_long:
            lines.append(
                f"{len(self.too_long)} lines longer than the encoder can represent were "
                f"left empty: {_lines(self.too_long)} (--truncate translates what the encoder represents)"
            )
        if self.truncated:
            lines.append(f"{len(self.truncated)} lines were truncated: {_lines(self.truncated)}")
        return lines


def _lines(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:20]))
    return f"lines {shown}" + (f" and {len(numbers) - 20} more" if len(numbers) > 20 else "")


def format_translation(number: int, result: Translation, nbest: int) -> str:
    """The output of one input line: its translation, or with ``nbest`` its n-best lines."""
    if not nbest:
        return (result.text or "") + "\n"
    entries = result.nbest or [(0.0 if result.text == "" else float("-inf"), "")]  # empty, or not translated
    return "".join(f"{number}\t{score:.4f}\t{text}\n" for score, text in entries)


def too_long_error(name: str, number: int, tokens: int, limit: int, at_least: bool = False) -> InputError:
    """The error of a line longer than ``--max-source-len``, naming it and both ways on."""
    counted = f"at least {tokens:,}" if at_least else f"{tokens:,}"
    return InputError(
        f"{name} line {number} has {counted} subword tokens, more than --max-source-len {limit:,}; raise "
        f"--max-source-len (decoding memory grows with the square of it), or pass --truncate to translate "
        f"its first {limit:,} tokens"
    )


def translate_stream(
    model: Transformer | Ensemble,
    tok: Tokenizer,
    lines: Iterator[str],
    out: IO[str],
    options: DecodeOptions,
    buffer_lines: int = 100_000,
    bar: Any = None,
    report: IO[str] | None = None,
    name: str = "<stdin>",
    tally: Tally | None = None,
) -> Tally:
    """Translate ``lines`` (of the input ``name``) into ``out`` in input order, ``buffer_lines`` at a
    time, each chunk written and flushed before the next is read; too-long lines are reported on
    ``report`` as they are met. A line over ``options.max_source_len`` stops with an ``InputError``
    naming it before its chunk is decoded; ``tally`` (returned) then counts the lines already written."""
    tally = tally if tally is not None else Tally()
    start = time.perf_counter()
    first, decoded = 1, [0]  # decoded: sentences of this chunk in decoded batches

    def done(n: int) -> None:
        decoded[0] += n
        if bar is not None:
            bar.update(n)

    while True:
        chunk = list(itertools.islice(lines, buffer_lines))
        if not chunk:
            break
        decoded[0] = 0
        try:
            results = decode_sentences(model, tok, chunk, options, on_batch=done)
        except SourceTooLong as err:
            raise too_long_error(name, first + err.index, err.tokens, err.limit, err.at_least) from None
        for number, result in enumerate(results, start=first):
            out.write(format_translation(number, result, options.nbest))
            tally.source_tokens += result.source_tokens
            tally.output_tokens += result.output_tokens
            if result.text is None:
                tally.too_long.append(number)
                if report is not None:
                    limit = model.max_source_length()
                    print(
                        f"tpe-translate: line {number}: {result.source_tokens} tokens + EOS, longer than the "
                        f"encoder's {limit} positions; left empty (--truncate translates its first "
                        f"{(limit or 1) - 1} tokens)",
                        file=report,
                    )
            elif result.truncated:
                tally.truncated.append(number)
        out.flush()
        if bar is not None:  # empty and too-long lines were in no batch
            bar.update(len(chunk) - decoded[0])
        tally.sentences += len(chunk)
        first += len(chunk)
    tally.seconds = time.perf_counter() - start
    return tally
