"""``tpe-data prepare --preset P [overrides]``: build the token store ahead of training, once, so that
the ranks of a multi-node job only read it. ``tpe-data check --preset P [overrides]``: the files the
corpus needs, the ones found, lines per side and every problem with its fix, before any training
(exit status 1 when there is a problem). Torch and the rest load after the arguments parse."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from tpe_train.run import logs
from tpe_train.run.members import MemberError

if TYPE_CHECKING:
    from tpe_train.config import DataConfig

log = logging.getLogger(__name__)


def _check(cfg_data: DataConfig) -> int:
    from tpe_train.data.check import check_corpus, suggested_vocab

    report = check_corpus(cfg_data)
    for line in report.lines:
        log.info("%s", line)
    for p in report.problems:
        stop = " (tpe-data prepare stops on this)" if p.stops else ""
        log.warning("%s: %s%s. Fix: %s", p.where, p.what, stop, p.fix)
    if report.train_pairs:
        size = suggested_vocab(report.train_pairs)
        log.info(
            "%s training pairs: a joint BPE of about %s (data.vocab_size=%d; now %d)",
            f"{report.train_pairs:,}",
            f"{size:,}",
            size,
            cfg_data.vocab_size,
        )
    if report.problems:
        log.warning("%d problems: fix them and run tpe-data check again", len(report.problems))
        return 1
    log.info("no problems found")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``tpe-data``."""
    parser = argparse.ArgumentParser(prog="tpe-data", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="clean, train the tokenizer, tokenise and store a corpus")
    check = sub.add_parser("check", help="list the corpus files expected and found, and their problems")
    for p in (prep, check):
        p.add_argument("--preset", default="demo", help="preset name in configs/presets or a YAML path")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.corpus=text data.path=DIR")
    args = parser.parse_args(argv)
    from tpe_train.config import ConfigError, load_config  # torch and the rest: after the arguments parse
    from tpe_train.data.prepare import prepare
    from tpe_train.data.sources import CorpusError

    logs.configure("tpe-data")
    try:
        cfg = load_config(args.preset, args.overrides)
        if args.command == "check":
            return _check(cfg.data)
        data = prepare(cfg.data)
    except (ConfigError, CorpusError, MemberError) as err:  # MemberError: a damaged token store
        log.error("%s", err)
        return 2
    for line in data.splits.report:
        log.info("cleaning %s", line)
    print(
        f"{'built' if data.built else 'reused'} {data.store}: {len(data.train)} training pairs "
        f"({data.dropped_too_long} longer than data.max_len={cfg.data.max_len} dropped), "
        f"{len(data.valid)} validation pairs, vocabulary {data.tokenizer.get_vocab_size()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
