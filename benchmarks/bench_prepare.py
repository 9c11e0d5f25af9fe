"""Preparation of a text corpus at growing sizes: ``tpe-data prepare`` on generated line-aligned text
files of N pairs, each size in a fresh process with its own store and ``datasets`` cache, and, with
``--old``, the same on another checkout of the project (an earlier commit) side by side.

    python benchmarks/bench_prepare.py --out /tmp/prep --sizes 1000000                # this tree
    python benchmarks/bench_prepare.py --out /tmp/prep --sizes 1000000 4000000 --old ../main
    python benchmarks/bench_prepare.py --out /tmp/prep --sizes 1000000 --old ../main --stages  # by stage
    python benchmarks/bench_prepare.py --smoke --json out.json                         # seconds

The corpus (``OUT/corpus-N/{train,validation,test}.{en,de}``, not committed): two generated languages
whose words follow a Zipf law over 50,000 types each, sentence lengths a log-normal with newstest's
median of 22 words (capped at 150), the German side 0.85-1.25 times as long, and 5% of the training
pairs repeated (so that de-duplication has work). Preparation: the demo preset's data section with
``data.corpus=text``, a joint BPE of ``--vocab`` words learned on ``data.tokenizer_sample`` pairs,
``data.clean.dedup=true``, ``data.num_proc=1``. The trees take turns going first at each size (a shared
machine's load changes). Figures per row: wall time, pairs/s, the peak PSS of the process tree and the
anonymous part of it (``harness.run_sampled``, sampled every second; the rest is mapped file pages,
which the kernel can drop), the store's size. The anonymous peak is what grows when a step holds the
corpus in Python objects.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
from harness import (
    ROOT,
    MemoryLimit,
    Sampled,
    dir_bytes,
    environment,
    parse_with_smoke,
    run_sampled,
    write_json,
)

GIB = 2**30
CHUNK = 200_000  # pairs generated and written at a time


def _words(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` distinct word types of 1-5 syllables (a repeated one gets its index appended)."""
    syllables = np.array([a + b for a in "bdfgklmnprstvwz" for b in ("a", "e", "i", "o", "u", "ei", "au")])
    counts = np.clip(rng.geometric(0.45, n), 1, 5)
    picks = rng.integers(len(syllables), size=(n, 5))
    seen: set[str] = set()
    words = []
    for i in range(n):
        word = "".join(syllables[picks[i, : counts[i]]])
        word = word if word not in seen else f"{word}{i}"
        seen.add(word)
        words.append(word)
    return np.array(words, dtype=object)


def _lines(rng: np.random.Generator, words: np.ndarray, cdf: np.ndarray, lengths: np.ndarray) -> list[str]:
    tokens = words[np.searchsorted(cdf, rng.random(int(lengths.sum())))]
    out, at = [], 0
    for n in lengths.tolist():
        out.append(" ".join(tokens[at : at + n].tolist()) + " .")
        at += n
    return out


def write_corpus(folder: Path, pairs: int, seed: int = 0, types: int = 50_000) -> None:
    """``train`` (``pairs`` lines), ``validation`` and ``test`` (2,000 each) in ``folder``."""
    rng = np.random.default_rng(seed)
    zipf = 1.0 / np.arange(1, types + 1) ** 1.07
    cdf = np.cumsum(zipf) / zipf.sum()
    vocab = {lang: _words(rng, types) for lang in ("en", "de")}
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", pairs), ("validation", 2000), ("test", 2000)):
        with open(folder / f"{split}.en", "w") as fe, open(folder / f"{split}.de", "w") as fd:
            for start in range(0, rows, CHUNK):
                n = min(CHUNK, rows - start)
                en_len = np.clip(np.rint(rng.lognormal(np.log(22), 0.55, n)), 1, 150).astype(np.int64)
                de_len = np.clip(np.rint(en_len * rng.uniform(0.85, 1.25, n)), 1, 160).astype(np.int64)
                en, de = _lines(rng, vocab["en"], cdf, en_len), _lines(rng, vocab["de"], cdf, de_len)
                if split == "train":  # 5% repeats of earlier pairs of the chunk
                    for i in rng.integers(n, size=n // 20).tolist():
                        j = int(rng.integers(n))
                        en[j], de[j] = en[i], de[i]
                fe.write("\n".join(en) + "\n")
                fd.write("\n".join(de) + "\n")


def run_limited(
    cmd: list[str], env: dict[str, str], tree: Path, limit_gib: float
) -> tuple[Sampled, dict[str, object]]:
    """``cmd`` run in ``tree`` (``-m`` puts the working folder first on the path: the tree's own), inside
    a memory cgroup of ``limit_gib`` GiB when that is not 0: then also the group's peak (mapped file
    pages included) and whether the kernel killed the run for memory."""
    if not limit_gib:
        return run_sampled(cmd, env, cwd=tree), {}
    group = MemoryLimit.make(int(limit_gib * GIB), f"bench-prepare-{os.getpid()}")
    try:
        r = run_sampled(cmd, env, preexec_fn=group.enter, cwd=tree)
        return r, {
            "limit_gib": limit_gib,
            "group_peak_gib": round(group.peak() / GIB, 3),
            "oom_kills": group.killed(),
        }
    finally:
        group.remove()


def prepare(tree: Path, corpus: Path, work: Path, args: argparse.Namespace) -> dict[str, object]:
    store, cache = work / "store", work / "hf-cache"
    shutil.rmtree(work, ignore_errors=True)
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "HF_DATASETS_CACHE": str(cache),
        "HF_DATASETS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "RAYON_NUM_THREADS": str(args.threads),
    }
    cmd = [sys.executable, "-m", "tpe_train.data.cli", "prepare", "--preset", "demo"]
    cmd += ["data.corpus=text", f"data.path={corpus}", f"data.store_dir={store}", "data.max_len=256"]
    cmd += [f"data.vocab_size={args.vocab}", f"data.tokenizer_sample={args.sample}", "data.clean.dedup=true"]
    r, limited = run_limited(cmd, env, tree, args.memory_limit)
    if r.returncode != 0 and limited.get("oom_kills"):
        shutil.rmtree(work, ignore_errors=True)
        return {"wall_s": round(r.wall_s, 1), "killed": True, **limited}
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.out[-3000:]}")
    lines = [line.removeprefix("tpe-data: ") for line in r.out.splitlines()]
    summary = [line for line in lines if line.startswith(("built", "cleaning"))]
    row = {
        "wall_s": round(r.wall_s, 1),
        "peak_pss_gib": round(r.peak_pss / GIB, 3),
        "peak_anon_gib": round(r.peak_anon / GIB, 3),
        "store_gib": round(dir_bytes(store) / GIB, 3),
        "summary": summary,
        **limited,
    }
    shutil.rmtree(work, ignore_errors=True)
    return row


STAGES = """
import json, resource, sys, time
from tpe_train.data.clean import CleanSpec, clean
from tpe_train.data.sources import SourceSpec, load_split
try:
    from tpe_train.data.dedup import first_of_each  # the pipeline's de-duplication stage
except ImportError:  # an older tree: de-duplication inside clean (one figure for both)
    first_of_each = None
out, start = {"dedup_s": None}, time.perf_counter()
def done(stage):  # its time, and the process's peak RSS so far
    global start
    out[f"{stage}_s"] = round(time.perf_counter() - start, 1)
    out["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)
    out[f"{stage}_peak_rss_gib"], start = out["peak_rss_gib"], time.perf_counter()
ds = load_split(SourceSpec(kind="text", src_lang="en", tgt_lang="de", path=sys.argv[1]), "train")
done("read")
if first_of_each is None:
    kept, dropped = clean(ds, CleanSpec(dedup=True))
    duplicates = dropped["duplicate"]
    done("clean")
else:
    kept, _ = clean(ds, CleanSpec())
    done("clean")
    kept, duplicates = first_of_each(kept)
    done("dedup")
print(json.dumps({**out, "kept": len(kept), "duplicates": duplicates}))
"""


def stages(tree: Path, corpus: Path, work: Path, limit_gib: float = 0) -> dict[str, object]:
    """Read, clean and de-duplicate only (no tokenizer), each timed, with the process's peak RSS after
    each: the steps that held the corpus. A tree from before de-duplication was a stage of its own
    gives one figure for clean and de-duplicate (``dedup_s`` null)."""
    shutil.rmtree(work, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_DATASETS_CACHE": str(work), "OMP_NUM_THREADS": "1"}
    r, limited = run_limited([sys.executable, "-c", STAGES, str(corpus)], env, tree, limit_gib)
    shutil.rmtree(work, ignore_errors=True)
    if r.returncode != 0 and limited.get("oom_kills"):
        return {"wall_s": round(r.wall_s, 1), "killed": True, **limited}
    if r.returncode != 0:
        sys.exit(f"stages failed ({r.returncode}):\n{r.out[-3000:]}")
    return {
        "wall_s": round(r.wall_s, 1),
        "peak_pss_gib": round(r.peak_pss / GIB, 3),
        "peak_anon_gib": round(r.peak_anon / GIB, 3),
        **json.loads(r.out.strip().splitlines()[-1]),
        **limited,
    }


def _stage_line(name: str, pairs: int, row: dict[str, object]) -> str:
    if row.get("killed"):
        return (
            f"{name:<10} {pairs:>10,} killed for memory after {row['wall_s']} s, limit {row['limit_gib']} GiB"
        )
    group = (
        f", memory group peak {row['group_peak_gib']} GiB of {row['limit_gib']}" if "limit_gib" in row else ""
    )
    dedup = "in clean" if row["dedup_s"] is None else f"{row['dedup_s']} s"
    return (
        f"{name:<10} {pairs:>10,} read {row['read_s']} s, clean {row['clean_s']} s, dedup {dedup}; "
        f"kept {row['kept']:,}, duplicates {row['duplicates']:,}; peak RSS {row['peak_rss_gib']} GiB, "
        f"sampled PSS {row['peak_pss_gib']} GiB, anon {row['peak_anon_gib']} GiB{group}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-prepare"), help="corpora and stores")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000], help="training pairs")
    parser.add_argument("--old", type=Path, help="another checkout of the project to compare with")
    parser.add_argument("--vocab", type=int, default=8000, help="joint BPE size")
    parser.add_argument("--sample", type=int, default=100_000, help="data.tokenizer_sample")
    parser.add_argument("--threads", type=int, default=2, help="tokenizers' threads")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--stages", action="store_true", help="read, clean, de-duplicate only, each timed")
    parser.add_argument(
        "--memory-limit", type=float, default=0, help="GiB: run each preparation in a memory cgroup this big"
    )
    args = parse_with_smoke(parser, argv, {"sizes": [3000], "vocab": 300, "sample": 1000, "threads": 1})
    args.out = args.out.resolve()  # the children run in the tree they measure
    trees = {"this tree": ROOT} | ({"old": args.old.resolve()} if args.old else {})
    rows = []
    for i, pairs in enumerate(args.sizes):
        corpus = args.out / f"corpus-{pairs}"
        if not (corpus / "test.de").is_file():
            write_corpus(corpus, pairs)
        order = list(trees.items())
        for name, tree in order[i % len(order) :] + order[: i % len(order)]:  # who goes first alternates
            print(f"preparing {pairs:,} pairs with {name} ({tree.name})", file=sys.stderr, flush=True)
            if args.stages:
                row = stages(tree, corpus, args.out / f"work-{pairs}", args.memory_limit)
                rows.append({"tree": name, "pairs": pairs, **row})
                print(_stage_line(name, pairs, row))
                continue
            row = prepare(tree, corpus, args.out / f"work-{pairs}", args)
            rate = None if row.get("killed") else round(pairs / float(row["wall_s"]))  # type: ignore[arg-type]
            rows.append({"tree": name, "pairs": pairs, "pairs_per_s": rate, **row})
    if args.stages:
        write_json(args.json, {"environment": environment(__import__("torch").device("cpu")), "rows": rows})
        return
    print(f"tpe-data prepare, text corpus, vocab {args.vocab}, tokenizer sample {args.sample}, dedup on")
    head = ("pairs", "wall s", "pairs/s", "PSS GiB", "anon GiB", "store GiB", "group GiB")
    print(f"{'tree':<10} " + " ".join(f"{h:>10}" for h in head))
    for r in rows:
        if r.get("killed"):
            print(
                f"{r['tree']:<10} {r['pairs']:>10,} killed for memory after {r['wall_s']} s, "
                f"limit {r['limit_gib']} GiB"
            )
            continue
        cells = [f"{r['pairs']:,}", r["wall_s"], r["pairs_per_s"], r["peak_pss_gib"], r["peak_anon_gib"]]
        cells += [r["store_gib"], r.get("group_peak_gib", "-")]
        print(f"{r['tree']:<10} " + " ".join(f"{c:>10}" for c in cells))
    for r in rows:
        print(f"{r['tree']} {r['pairs']:,}: " + " | ".join(r.get("summary", ["killed for memory"])))
    write_json(args.json, {"environment": environment(__import__("torch").device("cpu")), "rows": rows})


if __name__ == "__main__":
    main()
