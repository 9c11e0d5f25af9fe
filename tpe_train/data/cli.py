"""``tpe-data prepare --preset P [overrides]``: build the token store ahead of training, once, so that
the ranks of a multi-node job only read it."""

from __future__ import annotations

import argparse
import logging
import sys

from tpe_train.config import ConfigError, load_config
from tpe_train.data.corpus import prepare
from tpe_train.data.sources import CorpusError
from tpe_train.run import logs
from tpe_train.run.members import MemberError

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``tpe-data``."""
    parser = argparse.ArgumentParser(prog="tpe-data", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="clean, train the tokenizer, tokenise and store a corpus")
    prep.add_argument("--preset", default="demo", help="preset name in configs/presets or a YAML path")
    prep.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.corpus=text data.path=DIR")
    args = parser.parse_args(argv)
    logs.configure("tpe-data")
    try:
        cfg = load_config(args.preset, args.overrides)
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
