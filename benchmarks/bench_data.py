"""Data preparation throughput and the batch iterator's cost per training step.

    python benchmarks/bench_data.py --text newstest=DIR:newstest2014 --text multi30k=DIR:train
    python benchmarks/bench_data.py --smoke --json out.json     # small mode: generated text, a tiny model

Each ``--text NAME=DIR:SPLIT`` names a line-aligned pair ``DIR/SPLIT.en`` / ``DIR/SPLIT.de``
(e.g. ``../shared/data/newstest2014-en-de:newstest2014``, ``../shared/data/multi30k:train``).

1. Preparation, end to end (read, clean, tokenise, write): tpe-train's path (`datasets` Dataset,
   batched cleaning, batched ``encode_batch`` in ``Dataset.map``, Arrow store) against a plain Python
   loop that cleans and encodes one sentence at a time with the same tokenizer and writes JSON lines.
   The joint BPE is trained once beforehand (its time is printed apart) so both sides encode with it.
2. The batch iterator: the median time of ``next(batches)`` + ``collate`` per step, over a store of
   the largest corpus, against one training step (forward, loss, backward, Adam) of the Transformer
   base model (``--preset``'s: d 512, 8 heads, FFN 2048, 6 + 6 layers; vocabulary 8,000) on one batch
   of that store.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import unicodedata
from pathlib import Path

import torch
from harness import (
    SMOKE_MODEL,
    Batch,
    FnRow,
    TrainRow,
    build,
    interleave,
    parse_with_smoke,
    shared_data_stub,
    write_json,
)

from tpe_train.config import load_config
from tpe_train.data.batching import BatchIterator, collate, length_arrays
from tpe_train.data.clean import CleanSpec, clean
from tpe_train.data.sources import SourceSpec, load_split
from tpe_train.data.tokenise import to_dataset
from tpe_train.data.tokenizer import train_tokenizer


def ours(directory: str, split: str, tok, out: Path) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    ds = load_split(SourceSpec(kind="text", src_lang="en", tgt_lang="de", path=directory), split)
    ds, _ = clean(ds, CleanSpec())
    ds = to_dataset(ds, tok)
    ds.save_to_disk(str(out))
    return time.perf_counter() - start, len(ds)


def plain_loop(directory: str, split: str, tok, out: Path) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    n = 0
    with (
        open(Path(directory) / f"{split}.en", encoding="utf-8") as fs,
        open(Path(directory) / f"{split}.de", encoding="utf-8") as ft,
        open(out, "w") as fo,
    ):
        for s, t in zip(fs, ft, strict=True):
            s = " ".join(unicodedata.normalize("NFKC", s).split())
            t = " ".join(unicodedata.normalize("NFKC", t).split())
            ns, nt = len(s.split()), len(t.split())
            if not ns or not nt or max(ns, nt) > 250 or max(ns / nt, nt / ns) > 9:
                continue
            src = [*tok.encode(s, add_special_tokens=False).ids, 2]
            tgt = [*tok.encode(t, add_special_tokens=False).ids, 2]
            fo.write(json.dumps({"src_ids": src, "tgt_ids": tgt}) + "\n")
            n += 1
    return time.perf_counter() - start, n


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--text", action="append", help="NAME=DIR:SPLIT (required but in --smoke)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed base-model training steps")
    parser.add_argument("--preset", default="wmt14_en_de_base", help="the model of the training step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    # small mode: generated text (harness.shared_data_stub) unless --text, a tiny model (SMOKE_MODEL)
    args = parse_with_smoke(parser, None, {"repeats": 1, "steps": 1})
    if not args.text and not args.smoke:
        parser.error("--text NAME=DIR:SPLIT is required (one or more)")
    return args


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        if not args.text:  # --smoke
            stub = shared_data_stub(Path(tmp) / "data")
            args.text = [
                f"newstest={stub}/newstest2014-en-de:newstest2014",
                f"multi30k={stub}/multi30k:train",
            ]
        run(args)


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    corpora = []
    for item in args.text:
        name, _, rest = item.partition("=")
        directory, _, split = rest.rpartition(":")
        corpora.append((name, directory, split))

    print("1. preparation (read, clean, tokenise, write), median of", args.repeats)
    print(f"{'corpus':<12}{'pairs':>8}{'BPE train s':>13}{'tpe pairs/s':>14}{'loop pairs/s':>14}{'ratio':>8}")
    largest = None
    prepared = []
    for name, directory, split in corpora:
        raw = load_split(SourceSpec(kind="text", src_lang="en", tgt_lang="de", path=directory), split)
        t0 = time.perf_counter()
        tok = train_tokenizer((raw[c] for c in ("src", "tgt")), 8000)
        bpe_s = time.perf_counter() - t0
        with tempfile.TemporaryDirectory() as tmp:
            a = [ours(directory, split, tok, Path(tmp) / f"o{i}") for i in range(args.repeats)]
            b = [plain_loop(directory, split, tok, Path(tmp) / f"l{i}.jsonl") for i in range(args.repeats)]
        ta, n = statistics.median(x[0] for x in a), a[0][1]
        tb = statistics.median(x[0] for x in b)
        print(f"{name:<12}{n:>8}{bpe_s:>13.2f}{n / ta:>14.0f}{b[0][1] / tb:>14.0f}{tb / ta:>8.2f}")
        prepared.append({"corpus": name, "pairs": n, "bpe_s": bpe_s, "tpe_pairs_per_s": n / ta,
                         "loop_pairs_per_s": b[0][1] / tb, "ratio": tb / ta})  # fmt: skip
        if largest is None or n > largest[0]:
            largest = (n, directory, split, tok)

    assert largest is not None
    _, directory, split, tok = largest
    ds = to_dataset(
        load_split(SourceSpec(kind="text", src_lang="en", tgt_lang="de", path=directory), split), tok
    )
    src_len, tgt_len = length_arrays(ds)
    it = iter(BatchIterator(src_len, tgt_len, max_tokens=4096, seed=1))
    iterator = FnRow("next + collate", lambda: collate(ds, next(it)))
    interleave([iterator], 0, 200, torch.device("cpu"), "iterator", collect="never", quiet=True)
    cfg = load_config(args.preset, [*(SMOKE_MODEL if args.smoke else []), "data.vocab_size=8000"])
    model = build(cfg)
    step = TrainRow("base", model, [Batch.of(iterator.result)], torch.device("cpu"), cfg.train)
    interleave([step], 1, args.steps, torch.device("cpu"), "base step")
    it_ms, step_ms = 1000 * statistics.median(iterator.times), 1000 * statistics.median(step.times)
    print("\n2. batch iterator (next + collate, 4,096-token batches) vs one base-model training step")
    print(f"iterator {it_ms:.2f} ms/step, base step {step_ms:.0f} ms: {100 * it_ms / step_ms:.3f}% of a step")
    write_json(args.json, {"prepare": prepared, "iterator_ms": it_ms, "base_step_ms": step_ms})


if __name__ == "__main__":
    main()
