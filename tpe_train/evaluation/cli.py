"""The evaluation commands: ``tpe-eval`` scores an export on test sets (and tests it against another),
``tpe-translate`` translates a file or stdin with one. Their library halves are ``evaluate`` and
``translate``; this module only parses arguments, reports bad input and prints. The arguments are
parsed before torch and the library are imported: ``--help`` and a wrong option answer at once.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import itertools
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING

from tpe_train.evaluation.options import DIAGNOSTIC_PAIRS, JSON_NAME, MAX_SOURCE_LEN
from tpe_train.run import logs

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from tpe_train.config import DataConfig
    from tpe_train.evaluation.decoding import DecodeOptions
    from tpe_train.evaluation.evaluate import TestSet
    from tpe_train.evaluation.translate import Tally

log = logging.getLogger(__name__)


def _doc(module: str) -> str | None:
    """A module's docstring, read from its source without importing it (and torch)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    return ast.get_docstring(ast.parse(Path(spec.origin).read_text(encoding="utf-8")), clean=False)


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """What both commands take about the model they load: its device and test-time position settings."""
    parser.add_argument(
        "--device", default="auto", help="auto (the GPU if torch sees one, else the CPU), cpu, cuda or cuda:N"
    )
    parser.add_argument(
        "--position",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="test-time position setting, repeatable (docs/evaluation.md): rope.scaling=pi|ntk|yarn, "
        "rope.factor=F, alibi.slope_scale=C, t5.max_distance=M, learned.extend=interpolate, "
        "learned.factor=F, side=encoder|decoder|cross|both",
    )


# --------------------------------------------------------------------------------------------------
# tpe-eval


def eval_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tpe-eval",
        description=_doc("tpe_train.evaluation.evaluate"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--checkpoint",
        required=True,
        nargs="+",
        action="extend",
        help="an export (<run_dir>/checkpoint, tpe-ckpt average); several (of one vocabulary): decode "
        "with their ensemble (docs/evaluation.md)",
    )
    parser.add_argument(
        "--split", default=None, help="comma-separated splits of the model's corpus, each scored on its own"
    )
    parser.add_argument("--src", action="append", default=[], help="a source file (with --ref; repeatable)")
    parser.add_argument("--ref", action="append", default=[], help="its reference file, line by line")
    parser.add_argument(
        "--compare", default=None, metavar="BASELINE", help="another export: paired bootstrap test against it"
    )
    parser.add_argument("--samples", type=int, default=1000, help="bootstrap resamples (default 1000)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument(
        "--out", default=None, help="also write eval.json and the hypotheses scored into this directory"
    )
    parser.add_argument("--beam", type=int, default=None, help="override eval.beam (1: greedy)")
    parser.add_argument(
        "--limit",
        type=int,
        default=None,
        metavar="N",
        help="score only the first N pairs of each set, named SET[:N] (a quick check of a large model on "
        "a CPU; not comparable with a full set's figures)",
    )
    parser.add_argument(
        "--concat",
        default="",
        metavar="N[,N...]",
        help="also score every set as segments of N consecutive sentences (sources and references joined; "
        "named SET+xN): long inputs from real text, at N times the set's lengths",
    )
    add_model_options(parser)
    parser.add_argument(
        "--diagnostics",
        action="store_true",
        help=f"also measure position diagnostics on the first {DIAGNOSTIC_PAIRS} pairs of the first set "
        "(docs/positions.md): mean attention distance per layer and head, printed as a table and written "
        f"to {JSON_NAME} with position-similarity images in --out (else the working directory)",
    )
    return parser.parse_args(argv)


def _concat_sizes(text: str) -> list[int]:
    try:
        return [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        raise ValueError(f"--concat {text!r}: give whole numbers, e.g. --concat 2,3") from None


def _sets(args: argparse.Namespace, cfg: DataConfig) -> list[TestSet]:
    from tpe_train.evaluation.decoding import InputError
    from tpe_train.evaluation.evaluate import concatenated, config_sets, corpus_sets, file_set

    if len(args.src) != len(args.ref):
        raise InputError(
            f"{len(args.src)} --src but {len(args.ref)} --ref; give each source file its reference"
        )
    sets = corpus_sets(cfg, [n.strip() for n in args.split.split(",") if n.strip()]) if args.split else []
    sets += [file_set(src, ref) for src, ref in zip(args.src, args.ref, strict=True)]
    sets = sets or config_sets(cfg)
    sets += [concatenated(test, n) for n in _concat_sizes(args.concat) for test in list(sets)]
    if args.limit is not None:
        for test in sets:
            if len(test.pairs) > args.limit:
                test.name = f"{test.name}[:{args.limit}]"
            test.pairs, test.long = test.pairs[: args.limit], test.long[: args.limit]
            test.probe = test.probe[: 2 * (args.limit // 2)]  # minimal pairs stay whole
    names = [s.name for s in sets]
    for i, test in enumerate(sets):  # two files of one name: keep both
        if names.count(test.name) > 1:
            test.name = f"{test.name}.{i + 1}"
    return sets


def eval_main(argv: list[str] | None = None) -> int:
    """``tpe-eval``: score an export on test sets; with ``--compare``, test it against another."""
    args = eval_args(argv)
    import torch  # and the library: after the arguments parse

    from tpe_train.ckpt.export import load_export
    from tpe_train.config import ConfigError
    from tpe_train.evaluation.decoding import device_from_arg
    from tpe_train.evaluation.ensemble import load_models
    from tpe_train.evaluation.evaluate import (
        EvalFiles,
        compare,
        evaluate,
        format_comparison,
        format_evaluation,
    )
    from tpe_train.evaluation.position_report import report_diagnostics
    from tpe_train.model.transformer import Transformer

    logs.configure("tpe-eval")
    try:
        if args.beam is not None and args.beam < 1:
            raise ValueError("--beam must be at least 1")
        if args.samples < 1:
            raise ValueError("--samples must be at least 1")
        if args.limit is not None and args.limit < 1:
            raise ValueError("--limit must be at least 1 (sentences of each set)")
        device = device_from_arg(args.device)
        loaded = load_models(args.checkpoint, args.position)
        model, cfg, tok = loaded.model, loaded.cfg, loaded.tok
        other = load_export(args.compare) if args.compare else None
        sets = _sets(args, cfg.data)  # every file is read before any decoding
        if args.diagnostics:
            if not isinstance(model, Transformer):
                raise ValueError("--diagnostics measures one model's attention; give one --checkpoint")
            report = sys.stderr if args.json else None  # --json keeps stdout for the figures
            report_diagnostics(model.to(device), tok, cfg.data.max_len, sets[0].pairs, args.out, report)
    except (FileNotFoundError, ValueError, ConfigError) as err:  # CorpusError, InputError included
        log.error("%s", err)
        return 2
    if args.beam is not None:
        cfg.eval.beam = args.beam
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    lang = cfg.data.tgt_lang
    result = evaluate(model.to(device), tok, sets, cfg.eval, lang)
    ensemble = {"ensemble": loaded.describe()} if loaded.is_ensemble else {}
    if args.out:
        EvalFiles(args.out).write(result, {**result.figures(), **ensemble})
    if other is None:
        table = "\n".join(filter(None, [loaded.banner(), format_evaluation(result)]))
        print(json.dumps({**result.figures(), **ensemble}) if args.json else table)
        return 0
    b_model, _, b_tok = other
    baseline = evaluate(b_model.to(device), b_tok, sets, cfg.eval, lang)  # decoded as the system
    tests = compare(result, baseline, args.samples)
    system = " + ".join(loaded.checkpoints)  # one path, or an ensemble's
    if args.json:
        print(json.dumps({"system": system, **ensemble, "baseline": args.compare, "sets": {
            s.name: {"system": s.figures, "baseline": b.figures, "paired": tests[s.name].as_dict()}
            for s, b in zip(result.sets, baseline.sets, strict=True)}}))  # fmt: skip
    else:
        print(format_comparison(tests, system, args.compare))
    return 0


# --------------------------------------------------------------------------------------------------
# tpe-translate


def translate_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="tpe-translate",
        description=_doc("tpe_train.evaluation.translate"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        nargs="+",
        action="extend",
        help="an export (<run_dir>/checkpoint, tpe-ckpt average); several (of one vocabulary): translate "
        "with their ensemble (docs/evaluation.md)",
    )
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
    p.add_argument(
        "--truncate",
        action="store_true",
        help="cut sentences longer than --max-source-len or than the encoder represents, instead of stopping "
        "or leaving them empty",
    )
    p.add_argument(
        "--max-source-len",
        type=int,
        default=MAX_SOURCE_LEN,
        metavar="TOKENS",
        help=f"longest source line, in subword tokens (default {MAX_SOURCE_LEN}); a longer one stops the "
        "command naming it, or is cut with --truncate (decoding memory grows with the square of it)",
    )
    p.add_argument("--pieces", action="store_true", help="write subword pieces instead of detokenised text")
    p.add_argument("--buffer-lines", type=int, default=100_000, help="lines sorted and translated at a time")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when reading a file and stderr is a terminal)",
    )
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: train.threads)")
    add_model_options(p)
    return p.parse_args(argv)


def decode_options(args: argparse.Namespace, base: DecodeOptions) -> DecodeOptions:
    """The checkpoint's decoding with the command line's changes (``ValueError`` names a bad one)."""
    from dataclasses import replace

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
    if args.max_source_len < 1:
        raise ValueError(f"--max-source-len must be at least 1 (subword tokens), got {args.max_source_len}")
    flags = {"nbest": args.nbest, "truncate": args.truncate, "pieces": args.pieces}
    options = replace(base, **given, **flags, max_source_len=args.max_source_len)
    if args.nbest < 0:
        raise ValueError(f"--nbest must be at least 1 (or 0: the best only), got {args.nbest}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    if args.buffer_lines < 1:
        raise ValueError(f"--buffer-lines must be at least 1, got {args.buffer_lines}")
    options.check()
    return options


def _count_lines(path: str) -> int:
    """Lines of a file, every one checked for UTF-8 before any work (``InputError`` names the line)."""
    from tpe_train.evaluation.decoding import InputError, utf8_lines

    try:
        with open(path, "rb") as f:
            return sum(1 for _ in utf8_lines(f, path))
    except OSError as err:
        raise InputError(f"-i {path}: {err.strerror}; pass a UTF-8 text file, or - for stdin") from None


def _check_lengths(path: str, tok: Tokenizer, limit: int) -> None:
    """Every line of a file within ``limit`` subword tokens, checked before any decoding (an
    ``InputError`` names the first longer one and how many more there are)."""
    from tpe_train.evaluation.decoding import InputError, encode_capped, utf8_lines
    from tpe_train.evaluation.translate import too_long_error

    over: list[tuple[int, int, bool]] = []
    with open(path, "rb") as f:
        lines = utf8_lines(f, path)
        first = 1
        while chunk := list(itertools.islice(lines, 10_000)):
            ids, cut = encode_capped(tok, chunk, limit)
            over += [(first + i, len(seq), i in cut) for i, seq in enumerate(ids) if len(seq) > limit]
            first += len(chunk)
    if over:
        number, tokens, at_least = over[0]
        err = too_long_error(path, number, tokens, limit, at_least)
        more = f" ({len(over) - 1} more lines are longer too)" if len(over) > 1 else ""
        raise InputError(f"{err}{more}; nothing was translated")


@contextlib.contextmanager
def _output(path: str, tally: Tally) -> Iterator[IO[str]]:
    """stdout, or a file written under a temporary name and renamed into place when complete; a stop
    partway keeps what was written (``tally.sentences`` input lines) as ``<path>.partial``."""
    if path == "-":
        yield sys.stdout
        return
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            try:
                yield f
            except BaseException:
                f.flush()
                os.fsync(f.fileno())
                raise
        tmp.replace(target)
    except BaseException:
        if tally.sentences and tmp.exists():
            partial = target.with_name(target.name + ".partial")
            tmp.replace(partial)
            log.warning(
                "stopped after %s input lines; their translations are kept in %s",
                f"{tally.sentences:,}",
                partial,
            )
        raise
    finally:
        tmp.unlink(missing_ok=True)


def translate_main(argv: list[str] | None = None) -> int:
    """Entry point of ``tpe-translate``."""
    args = translate_args(argv)
    import torch  # and the library: after the arguments parse
    from tqdm import tqdm

    from tpe_train.config import ConfigError
    from tpe_train.evaluation.decoding import DecodeOptions, InputError, device_from_arg, utf8_lines
    from tpe_train.evaluation.ensemble import load_models
    from tpe_train.evaluation.translate import Tally, translate_stream

    logs.configure("tpe-translate", info_stream="stderr")  # stdout: the translations
    try:
        device = device_from_arg(args.device)
        total = _count_lines(args.input) if args.input != "-" else None
        if args.output != "-" and not Path(args.output).resolve().parent.is_dir():
            raise InputError(f"-o {args.output}: its directory does not exist")
        loaded = load_models(args.checkpoint, args.position)
        model, cfg, tok = loaded.model, loaded.cfg, loaded.tok
        options = decode_options(args, DecodeOptions.of(cfg.eval))
        if total is not None and not options.truncate:
            _check_lengths(args.input, tok, options.max_source_len)
    except (FileNotFoundError, ValueError, ConfigError) as err:  # InputError included
        log.error("%s", err)
        return 2
    threads = args.threads or cfg.train.threads
    if threads:
        torch.set_num_threads(threads)
    model.to(device)
    if loaded.is_ensemble:
        log.info("%s", loaded.banner())
    show = args.progress if args.progress is not None else (total is not None and sys.stderr.isatty())
    tally = Tally()
    try:
        with contextlib.ExitStack() as stack:
            source = stack.enter_context(open(args.input, "rb")) if total is not None else sys.stdin.buffer
            out = stack.enter_context(_output(args.output, tally))
            bar = stack.enter_context(tqdm(total=total, unit="sent", disable=not show, file=sys.stderr))
            name = args.input if total is not None else "<stdin>"
            lines = utf8_lines(source, name)
            translate_stream(model, tok, lines, out, options, args.buffer_lines, bar, sys.stderr, name, tally)
    except InputError as err:  # stdin: bytes that are not UTF-8 or a line too long, after some lines
        log.error("%s", err)
        return 2
    except KeyboardInterrupt:
        log.warning("interrupted after %s input lines", f"{tally.sentences:,}")
        return 130
    except torch.OutOfMemoryError:
        log.error(
            "out of device memory while decoding the lines after line %s; lower --max-tokens (tokens per "
            "batch) or --max-source-len, or pass --truncate",
            f"{tally.sentences:,}",
        )
        return 1
    for line in tally.summary():
        log.info("%s", line)
    return 0
