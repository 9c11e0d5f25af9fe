"""``tpe-translate``: translate a file or stdin with an export, in input order.

    tpe-translate --checkpoint runs/demo-sinusoidal-s1/checkpoint -i test.en -o test.hyp
    echo "the small cat helps a river ." | tpe-translate --checkpoint DIR
    tpe-translate --checkpoint DIR -i test.en --nbest 4          # LINE<TAB>SCORE<TAB>TEXT, best first
    tpe-translate --checkpoint DIR -i test.en --beam 1           # greedy

Sentences are sorted by length and decoded in batches of at most ``--max-tokens`` padded source tokens
(``--buffer-lines`` lines are read, sorted and translated at a time), then written in input order,
detokenised (``--pieces``: the subword pieces). Decoding defaults are the checkpoint's ``eval`` section.
An empty line gives an empty line. A sentence longer than the encoder's position encoding can represent
(a learned table) gives an empty line and is reported by line number on stderr, or is cut to what the
encoder represents with ``--truncate``. Bytes that are not UTF-8 stop the command with the line named
(for a file, before anything is translated); a file named by ``-o`` is written only when every line is
translated. Throughput is printed on stderr at the end. Exit status: 0 done, 2 bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from tpe_train.config import ConfigError
from tpe_train.decoding import (
    DecodeOptions,
    InputError,
    Translation,
    decode_sentences,
    device_from_arg,
    utf8_lines,
)
from tpe_train.model.transformer import Transformer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="tpe-translate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--checkpoint", required=True, help="an export (<run_dir>/checkpoint, tpe-ckpt average)")
    p.add_argument("-i", "--input", default="-", help="a UTF-8 text file, one sentence a line; - for stdin")
    p.add_argument("-o", "--output", default="-", help="where the translations go; - for stdout")
    p.add_argument("--beam", type=int, default=None, help="beam size (default: eval.beam; 1: greedy)")
    p.add_argument("--greedy", action="store_true", help="greedy decoding (--beam 1)")
    p.add_argument("--length-penalty", type=float, default=None, help="alpha of ((5 + len) / 6) ** alpha")
    p.add_argument("--max-len-a", type=float, default=None, help="at most a * source tokens + b tokens out")
    p.add_argument("--max-len-b", type=int, default=None, help="see --max-len-a")
    p.add_argument("--max-tokens", type=int, default=None, help="padded source tokens per batch")
    p.add_argument("--batch-size", type=int, default=None, help="sentences per batch at most")
    p.add_argument("--nbest", type=int, default=0, help="N best per sentence: LINE<TAB>SCORE<TAB>TEXT lines")
    p.add_argument("--truncate", action="store_true", help="cut sentences too long for the encoder")
    p.add_argument("--pieces", action="store_true", help="write subword pieces instead of detokenised text")
    p.add_argument("--buffer-lines", type=int, default=100_000, help="lines sorted and translated at a time")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when reading a file and stderr is a terminal)",
    )
    p.add_argument(
        "--device", default="auto", help="auto (the GPU if torch sees one, else the CPU), cpu, cuda or cuda:N"
    )
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: train.threads)")
    return p.parse_args(argv)


def decode_options(args: argparse.Namespace, base: DecodeOptions) -> DecodeOptions:
    """The checkpoint's decoding with the command line's changes (``ValueError`` names a bad one)."""
    changes = {
        "beam": 1 if args.greedy else args.beam,
        "alpha": args.length_penalty,
        "max_len_a": args.max_len_a,
        "max_len_b": args.max_len_b,
        "max_tokens": args.max_tokens,
        "batch_size": args.batch_size,
    }
    if args.greedy and args.beam not in (None, 1):
        raise ValueError(f"--greedy is --beam 1; drop --beam {args.beam} or --greedy")
    given = {key: value for key, value in changes.items() if value is not None}
    options = replace(base, **given, nbest=args.nbest, truncate=args.truncate, pieces=args.pieces)
    if args.nbest < 0:
        raise ValueError(f"--nbest must be at least 1 (or 0: the best only), got {args.nbest}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    if args.buffer_lines < 1:
        raise ValueError(f"--buffer-lines must be at least 1, got {args.buffer_lines}")
    options.check()
    return options


@dataclass
class Tally:
    """What was translated, for the closing line on stderr."""

    sentences: int = 0
    source_tokens: int = 0
    output_tokens: int = 0
    too_long: list[int] = field(default_factory=list)  # line numbers left untranslated
    truncated: list[int] = field(default_factory=list)  # line numbers cut to the encoder's length
    seconds: float = 0.0

    def summary(self) -> str:
        s = max(self.seconds, 1e-9)
        line = (
            f"tpe-translate: {self.sentences:,} sentences ({self.source_tokens:,} source, "
            f"{self.output_tokens:,} output tokens) in {self.seconds:.1f} s: {self.sentences / s:,.1f} "
            f"sentences/s, {self.output_tokens / s:,.0f} output tokens/s"
        )
        if self.too_long:
            line += (
                f"\ntpe-translate: {len(self.too_long)} lines longer than the encoder can represent were "
                f"left empty: {_lines(self.too_long)} (--truncate translates what the encoder represents)"
            )
        if self.truncated:
            line += f"\ntpe-translate: {len(self.truncated)} lines were truncated: {_lines(self.truncated)}"
        return line


def _lines(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:20]))
    return f"lines {shown}" + (f" and {len(numbers) - 20} more" if len(numbers) > 20 else "")


def format_translation(number: int, result: Translation, nbest: int) -> str:
    """The output of one input line: its translation, or with ``nbest`` its n-best lines."""
    if not nbest:
        return (result.text or "") + "\n"
    entries = result.nbest or [(0.0 if result.text == "" else float("-inf"), "")]  # empty, or not translated
    return "".join(f"{number}\t{score:.4f}\t{text}\n" for score, text in entries)


def translate_stream(
    model: Transformer,
    tok: Tokenizer,
    lines: Iterator[str],
    out: IO[str],
    options: DecodeOptions,
    buffer_lines: int = 100_000,
    bar: Any = None,
    report: IO[str] | None = None,
) -> Tally:
    """Translate ``lines`` into ``out`` in input order, ``buffer_lines`` at a time; too-long lines are
    reported on ``report`` as they are met. Returns what was done."""
    tally = Tally()
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
        results = decode_sentences(model, tok, chunk, options, on_batch=done)
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


def _count_lines(path: str) -> int:
    """Lines of a file, every one checked for UTF-8 before any work (``InputError`` names the line)."""
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in utf8_lines(f, path))
    except OSError as err:
        raise InputError(f"-i {path}: {err.strerror}; pass a UTF-8 text file, or - for stdin") from None


@contextlib.contextmanager
def _output(path: str) -> Iterator[IO[str]]:
    """stdout, or a file written under a temporary name and renamed into place when complete."""
    if path == "-":
        yield sys.stdout
        return
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            yield f
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``tpe-translate``."""
    from tpe_train.ckpt.export import load_export

    args = parse_args(argv)
    try:
        device = device_from_arg(args.device)
        total = _count_lines(args.input) if args.input != "-" else None
        if args.output != "-" and not Path(args.output).resolve().parent.is_dir():
            raise InputError(f"-o {args.output}: its directory does not exist")
        model, cfg, tok = load_export(args.checkpoint)
        options = decode_options(args, DecodeOptions.of(cfg.eval))
    except (FileNotFoundError, ValueError, ConfigError) as err:  # InputError included
        print(f"tpe-translate: {err}", file=sys.stderr)
        return 2
    threads = args.threads or cfg.train.threads
    if threads:
        torch.set_num_threads(threads)
    model.to(device)
    show = args.progress if args.progress is not None else (total is not None and sys.stderr.isatty())
    try:
        with contextlib.ExitStack() as stack:
            source = stack.enter_context(open(args.input, "rb")) if total is not None else sys.stdin.buffer
            out = stack.enter_context(_output(args.output))
            bar = stack.enter_context(tqdm(total=total, unit="sent", disable=not show, file=sys.stderr))
            name = args.input if total is not None else "<stdin>"
            tally = translate_stream(
                model, tok, utf8_lines(source, name), out, options, args.buffer_lines, bar, sys.stderr
            )
    except InputError as err:  # stdin: bytes that are not UTF-8 after some lines were translated
        print(f"tpe-translate: {err}", file=sys.stderr)
        return 2
    print(tally.summary(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
