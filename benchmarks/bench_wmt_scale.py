"""Data at WMT scale, simulated: a generated corpus of 4.5 million pairs in the Hugging Face ``wmt14``
parquet layout, prepared with the ``wmt14_en_de_base`` preset, and the token-batch iterator over it.

    python benchmarks/bench_wmt_scale.py --out /tmp/wmt-sim                  # 4.5M pairs, num_proc 1 and 2
    python benchmarks/bench_wmt_scale.py --out /tmp/wmt-sim --pairs 200000 --write-only   # a corpus only
    python benchmarks/bench_wmt_scale.py --smoke --json out.json   # small mode: 2,000 pairs of 5,000 word
                                                                   # types, a tiny model, seconds

1. The corpus (``OUT/corpus/de-en/{train,validation,test}-0000i-of-0000N.parquet``, a ``translation``
   column of ``{"de": ..., "en": ...}`` as on the hub; not committed). Generated text: two synthetic
   languages whose words follow a Zipf law over 150,000 types each (exponent 1.07), sentence lengths a
   log-normal fitted to newstest2014's English side (median 22 words, long tail, capped at 150), the
   German side 0.85-1.25 times as long, numbers and punctuation as tokens of their own.
2. ``tpe-data prepare --preset wmt14_en_de_base`` on it (37,000-token joint BPE, learned on
   ``data.tokenizer_sample`` = 1,000,000 pairs spread over the corpus), once with ``data.num_proc=1``
   and once with 2, each in a fresh process with its own store and ``datasets`` cache: wall time,
   pairs/s, the peak memory of the process tree (``harness.run_sampled``: PSS summed over its
   processes, and the anonymous part of it; sampled every second), the store's size.
3. The batch iterator over that store in a fresh process: start-up (open the store, cut the epoch into
   batches of 6,250 tokens, first batch), resident memory, median ms per batch (``next`` + collate), and
   one Transformer-base training step (forward, label-smoothed loss, backward, Adam; 37,000 words) on
   batches of that store, so that the iterator's share of a step is measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from harness import (
    SMOKE_MODEL,
    Batch,
    FnRow,
    TrainRow,
    dir_bytes,
    interleave,
    parse_with_smoke,
    resident,
    run_checked,
    run_sampled,
    write_json,
)

PRESET = "wmt14_en_de_base"
SHARD = 500_000  # rows per parquet file, as the hub's shards hold a few hundred thousand


# --- 1. the corpus ------------------------------------------------------------------------------------


def _words(rng: np.random.Generator, n: int, lang: str) -> np.ndarray:
    """``n`` distinct pronounceable word types, frequent ones short (as in natural languages)."""
    onsets = ["b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z", "sch", "st"]
    onsets += ["tr", "br", "kl", "pr", "gr", "ch", "th", "sh"] if lang == "en" else ["pf", "kr", "ei", "au"]
    nuclei = ["a", "e", "i", "o", "u", "ie", "ou", "ea", "ä", "ü", "ö"][: 9 if lang == "en" else 11]
    codas = ["", "", "n", "r", "s", "t", "l", "ng", "ck", "nd", "st"]
    seen: set[str] = set()
    out: list[str] = []
    while len(out) < n:
        syllables = 1 + min(4, int(rng.exponential(0.35 + 2.2 * len(out) / n)))
        word = "".join(
            onsets[rng.integers(len(onsets))]
            + nuclei[rng.integers(len(nuclei))]
            + codas[rng.integers(len(codas))]
            for _ in range(syllables)
        )
        if word not in seen:
            seen.add(word)
            out.append(word)
    return np.array(out, dtype=object)


def _sentences(
    rng: np.random.Generator, words: np.ndarray, cdf: np.ndarray, lengths: np.ndarray
) -> list[str]:
    ids = np.searchsorted(cdf, rng.random(int(lengths.sum())))
    tokens = words[ids]
    punct = rng.random(len(lengths))
    out, at = [], 0
    for n, p in zip(lengths.tolist(), punct.tolist(), strict=True):
        body = " ".join(tokens[at : at + n].tolist())
        at += n
        out.append(body + (" ." if p < 0.85 else " ?" if p < 0.9 else " , " + str(int(p * 1000)) + " ."))
    return out


def write_corpus(out: Path, pairs: int, seed: int = 0, types: int = 150_000) -> dict[str, int]:
    """The three splits in the hub's layout under ``out/de-en``, ``types`` words a language; returns
    rows per split."""
    rng = np.random.default_rng(seed)
    zipf = 1.0 / np.arange(1, types + 1) ** 1.07
    cdf = np.cumsum(zipf) / zipf.sum()
    vocab = {lang: _words(rng, types, lang) for lang in ("en", "de")}
    folder = out / "de-en"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    sizes = {"train": pairs, "validation": 3000, "test": 3003}
    for split, rows in sizes.items():
        shards = max(1, -(-rows // SHARD))
        for k in range(shards):
            n = min(SHARD, rows - k * SHARD)
            en_len = np.clip(np.rint(rng.lognormal(np.log(22), 0.55, n)), 1, 150).astype(np.int64)
            de_len = np.clip(np.rint(en_len * rng.uniform(0.85, 1.25, n)), 1, 160).astype(np.int64)
            en = _sentences(rng, vocab["en"], cdf, en_len)
            de = _sentences(rng, vocab["de"], cdf, de_len)
            pairs_ = pa.StructArray.from_arrays([pa.array(de), pa.array(en)], names=["de", "en"])
            table = pa.table({"translation": pairs_})
            pq.write_table(table, folder / f"{split}-{k:05d}-of-{shards:05d}.parquet")
    return sizes


# --- 2. preparation -----------------------------------------------------------------------------------


class MemoryCage:
    """A memory cgroup (v1 or v2) with a hard limit, made below this process's own. The kernel keeps a
    command run in it within the limit by reclaiming page cache (the mapped Arrow files); one that needs
    more than that (anonymous memory) is killed by its OOM killer. Needs write access to the cgroup file
    system (root on this machine)."""

    def __init__(self, limit_bytes: int, name: str) -> None:
        line = next(ln for ln in Path("/proc/self/cgroup").read_text().splitlines() if self._ours(ln))
        here = line.split(":", 2)[2].lstrip("/")
        v1 = Path("/sys/fs/cgroup/memory")
        self.dir = (v1 / here if v1.is_dir() else Path("/sys/fs/cgroup") / here) / name
        self.dir.mkdir(exist_ok=True)
        self.v1 = v1.is_dir()
        limit = "memory.limit_in_bytes" if self.v1 else "memory.max"
        (self.dir / limit).write_text(str(limit_bytes))
        self.limit = limit_bytes

    @staticmethod
    def _ours(line: str) -> bool:
        controllers = line.split(":", 2)[1]
        v2 = controllers == "" and not Path("/sys/fs/cgroup/memory").is_dir()
        return "memory" in controllers.split(",") or v2

    def enter(self) -> None:
        """In the child, before exec: move itself into the cgroup (its own children follow)."""
        (self.dir / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int:
        """Peak memory charged to the cgroup (anonymous + page cache), bytes."""
        name = "memory.max_usage_in_bytes" if self.v1 else "memory.peak"
        path = self.dir / name
        return int(path.read_text()) if path.is_file() else -1

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.dir.rmdir()


def run_measured(
    cmd: list[str], env: dict[str, str], cage: MemoryCage | None = None
) -> tuple[float, int, int, str]:
    """(wall seconds, peak PSS and peak anonymous PSS of the process tree in bytes, stdout) of one
    command, sampled once a second (``harness.run_sampled``). ``cage``: run it inside that memory
    cgroup (the kernel enforces its limit)."""
    r = run_sampled(cmd, env, preexec_fn=cage.enter if cage is not None else None)
    if r.returncode != 0:
        killed = " (killed: over the memory limit?)" if r.returncode in (-9, 137) and cage else ""
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}){killed}:\n{r.out[-3000:]}")
    return r.wall_s, r.peak_pss, r.peak_anon, r.out


def overrides(corpus: Path, store: Path, num_proc: int) -> list[str]:
    return [
        "data.corpus=parquet",
        f"data.path={corpus}",
        f"data.store_dir={store}",
        f"data.num_proc={num_proc}",
    ]


def prepare(corpus: Path, work: Path, num_proc: int, limit_gb: float | None) -> dict[str, float]:
    store, cache = work / f"store-np{num_proc}", work / f"hf-cache-np{num_proc}"
    shutil.rmtree(store, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "tpe_train.data.cli",
        "prepare",
        "--preset",
        PRESET,
        *overrides(corpus, store, num_proc),
    ]
    cage = MemoryCage(int(limit_gb * 1e9), f"bench-wmt-np{num_proc}") if limit_gb else None
    try:
        wall, pss, anon, out = run_measured(cmd, env, cage)
        charged = cage.peak() if cage is not None else -1
    finally:
        if cage is not None:
            cage.remove()
    line = next(ln for ln in out.splitlines() if ln.startswith("built "))
    kept = int(line.split(": ")[1].split(" training pairs")[0])
    return {
        "num_proc": num_proc,
        "wall_s": wall,
        "peak_pss_gib": pss / 2**30,
        "peak_anon_gib": anon / 2**30,
        "memory_limit_gb": limit_gb,
        "cgroup_peak_gib": charged / 2**30 if charged >= 0 else None,
        "store_gib": dir_bytes(store) / 2**30,
        "cache_gib": dir_bytes(cache) / 2**30,
        "kept_pairs": kept,
        "summary": line,
    }


# --- 3. the iterator, and a base step -----------------------------------------------------------------


def iterator_child(corpus: Path, store: Path, batches: int, steps: int, smoke: bool) -> None:
    """In a fresh process: start-up, memory and ms per batch of the iterator, then base-model steps."""
    import torch

    from tpe_train.config import load_config
    from tpe_train.data.batching import model_args
    from tpe_train.data.prepare import prepare as prepare_data
    from tpe_train.data.train_batches import TrainBatches
    from tpe_train.model.build import build_model

    rss0 = resident()["VmRSS"]
    cfg = load_config(PRESET, [*overrides(corpus, store, 1), *(SMOKE_MODEL if smoke else [])])
    start = time.perf_counter()
    data = prepare_data(cfg.data)
    it = TrainBatches(data, cfg.data, seed=1)
    first = next(it)
    startup = time.perf_counter() - start
    iterator = FnRow("next", lambda: next(it))
    interleave([iterator], 0, batches, torch.device("cpu"), "iterator", collect="never", quiet=True)
    rss = resident()["VmRSS"]
    torch.set_num_threads(2)
    model = build_model(model_args(cfg.model, data.tokenizer.get_vocab_size()))
    step_batches = [Batch.of(b) for b in [first, *(next(it) for _ in range(steps))]]  # one warm-up
    step = TrainRow("base", model, step_batches, torch.device("cpu"), cfg.train)
    interleave([step], 1, steps, torch.device("cpu"), "base step", collect="never", quiet=True)
    print(
        "RESULT "
        + json.dumps(
            {
                "train_pairs": len(data.train),
                "batches_per_epoch": len(it.batches.batches) if it.batches is not None else None,
                "startup_s": startup,
                "rss_gib": rss / 2**30,
                "rss_added_gib": (rss - rss0) / 2**30,
                "ms_per_batch": 1000 * statistics.median(iterator.times),
                "base_step_ms": 1000 * statistics.median(step.times),
                "tokens_first_batch": int(first.src.numel() + first.tgt_in.numel()),
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out", type=Path, help="work directory (corpus, stores, caches); required but in --smoke"
    )
    ap.add_argument("--pairs", type=int, default=4_500_000)
    ap.add_argument("--num-proc", default="1,2", help="data.num_proc values to prepare with")
    ap.add_argument("--batches", type=int, default=300, help="iterator batches timed")
    ap.add_argument("--steps", type=int, default=2, help="base-model steps timed (after one warm-up)")
    ap.add_argument("--write-only", action="store_true", help="write the corpus, measure nothing")
    ap.add_argument("--reuse-corpus", action="store_true", help="keep OUT/corpus if it is there")
    ap.add_argument(
        "--memory-limit",
        type=float,
        default=None,
        metavar="GB",
        help="run each preparation in a memory cgroup of this hard limit (needs root): it completes only "
        "if the kernel can keep it within the limit",
    )
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", nargs=2, metavar=("CORPUS", "STORE"), help=argparse.SUPPRESS)
    # small mode: a corpus of 5,000 word types a language in a temporary --out, a tiny model (SMOKE_MODEL)
    args = parse_with_smoke(ap, None, {"pairs": 2000, "num_proc": "1", "batches": 20, "steps": 1})
    if args.child:
        iterator_child(Path(args.child[0]), Path(args.child[1]), args.batches, args.steps, args.smoke)
        return
    if args.out is None and not args.smoke:
        ap.error("--out DIR is required")
    with tempfile.TemporaryDirectory(prefix="bench-wmt-") as tmp:
        if args.out is None:
            args.out = Path(tmp)
        run(args)


def run(args: argparse.Namespace) -> None:
    corpus = args.out / "corpus"
    if not (args.reuse_corpus and (corpus / "de-en").is_dir()):
        t0 = time.perf_counter()
        sizes = write_corpus(corpus, args.pairs, types=5000 if args.smoke else 150_000)
        print(
            f"corpus: {sizes} pairs in {corpus} ({dir_bytes(corpus) / 2**30:.2f} GiB parquet), "
            f"written in {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
    if args.write_only:
        return
    pairs = sum(pq.ParquetFile(f).metadata.num_rows for f in (corpus / "de-en").glob("train-*.parquet"))
    results: dict[str, object] = {"pairs": pairs, "prepare": []}
    print(f"\n1. tpe-data prepare --preset {PRESET} data.corpus=parquet, {pairs:,} training pairs")
    print(
        f"{'num_proc':>8} {'wall s':>8} {'pairs/s':>9} {'peak PSS GiB':>13} {'of it anon':>10} "
        f"{'cgroup GiB':>10} {'store GiB':>10} {'HF cache GiB':>13}"
    )
    if args.memory_limit:
        print(f"(each inside a memory cgroup limited to {args.memory_limit:g} GB; cgroup: its peak charge)")
    for n in [int(x) for x in args.num_proc.split(",")]:
        r = prepare(corpus, args.out, n, args.memory_limit)
        results["prepare"].append(r)  # type: ignore[union-attr]
        print(
            f"{n:>8} {r['wall_s']:>8.0f} {pairs / r['wall_s']:>9.0f} {r['peak_pss_gib']:>13.2f} "
            f"{r['peak_anon_gib']:>10.2f} "
            + (f"{r['cgroup_peak_gib']:>10.2f} " if r["cgroup_peak_gib"] is not None else f"{'-':>10} ")
            + f"{r['store_gib']:>10.2f} {r['cache_gib']:>13.2f}   {r['summary']}",
            flush=True,
        )
    store = args.out / f"store-np{int(args.num_proc.split(',')[0])}"
    cmd = [
        sys.executable,
        __file__,
        "--out",
        str(args.out),
        "--batches",
        str(args.batches),
        "--steps",
        str(args.steps),
        "--child",
        str(corpus),
        str(store),
        *(["--smoke"] if args.smoke else []),
    ]
    proc = run_checked(cmd, env={**os.environ, "HF_DATASETS_OFFLINE": "1"}, tail=3000)
    it = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    results["iterator"] = it
    share = it["ms_per_batch"] / it["base_step_ms"]
    print("\n2. token-batch iterator over the store (data.max_tokens=6250), fresh process")
    print(
        f"start-up (open store, cut {it['batches_per_epoch']:,} batches, first batch): "
        f"{it['startup_s']:.1f} s"
    )
    print(
        f"resident memory after {args.batches} batches: {it['rss_gib']:.2f} GiB "
        f"({it['rss_added_gib']:.2f} GiB added by the store and the iterator)"
    )
    print(
        f"next + collate: {it['ms_per_batch']:.2f} ms per batch; Transformer-base step (37k words, "
        f"2 threads): {it['base_step_ms']:.0f} ms: {100 * share:.3f}% of a step"
    )
    peak = max(r["peak_pss_gib"] for r in results["prepare"])  # type: ignore[union-attr]
    anon = max(r["peak_anon_gib"] for r in results["prepare"])  # type: ignore[union-attr]
    caged = args.memory_limit is not None and args.memory_limit <= 3
    memory = f"PSS {peak * 2**30 / 1e9:.2f} GB, anonymous {anon * 2**30 / 1e9:.2f} GB: " + (
        "met"
        if peak * 2**30 <= 3e9
        else f"met (completed inside a {args.memory_limit:g} GB memory cgroup)"
        if caged
        else "the anonymous part within it (rerun with --memory-limit 3 to have the kernel enforce it)"
        if anon * 2**30 <= 3e9
        else "NOT met"
    )
    print(
        "\ngoals: peak memory <= 3 GB: {}; iterator start-up <= 20 s: {}; iterator <= 2% of a step: "
        "{}".format(
            memory,
            f"{it['startup_s']:.1f} s " + ("met" if it["startup_s"] <= 20 else "NOT met"),
            f"{100 * share:.3f}% " + ("met" if share <= 0.02 else "NOT met"),
        )
    )
    write_json(args.json, results)


if __name__ == "__main__":
    main()
