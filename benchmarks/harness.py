"""What the benchmarks share: one copy of how they synchronise, time, build models and batches,
measure the GEMM peak and memory, and write their figures.

Scripts import it as ``from harness import ...`` (``python benchmarks/x.py`` puts ``benchmarks/`` first
on ``sys.path``; the package itself is installed), the GPU checks of ``gpu/`` as ``benchmarks.harness``.
The Hugging Face peers are in ``peers.py``, which imports this module (never the other way).

- **Timing** (``interleave``): every row warmed up first (its untimed steps), then rounds of one timed
  step per row, the order rotated every round, so that a load change on a shared machine hits all rows
  alike; each step is bracketed by ``sync`` (GPU kernels are asynchronous). ``summary``: median, min
  and 90th percentile of a row's times.
- **Peak** (``PeakRow``): the GEMM peak of ``tpe_train.train.throughput`` (every kernel on the model's
  own GEMM shapes, ``gemm_shapes``) as a row of the interleaved rounds, so that the peak behind MFU is
  measured under the same machine load as the steps.
- **Models and batches from a config**: ``build`` (``cfg.model.args``), ``bench_config`` (the shape of
  ``bench_train.py``), ``Uniform`` (random ids, uniform lengths) and ``length_batches`` (given lengths
  cut as training cuts them); ``TrainRow`` times a training step of either kind of model with the
  trainer's optimizer and schedule (``trainer_optimizer``: ``tpe_train.train.build``).
- **Memory**: ``saved_bytes`` (what autograd keeps for the backward), ``resident`` and
  ``added_peak_rss`` (this process), ``tree_memory`` and ``run_sampled`` (a process tree's PSS).
- **Output**: ``environment``, ``write_json``; ``run_checked``, ``accelerate_cmd``, ``tb_scalars`` for the
  scripts that start the project's commands.
- **Small modes**: ``parse_with_smoke`` (every script's ``--smoke``, which tests/test_benchmarks.py
  runs), ``SMOKE_MODEL`` / ``SMOKE_SHAPE`` (a tiny model over the script's own preset),
  ``shared_data_stub`` (generated text in the layout of ``../shared/data``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from tpe_train.config import Config, TrainConfig, load_config
from tpe_train.data.batching import BOS_ID, EOS_ID, PAD_ID, token_batches
from tpe_train.data.batching import model_args as model_args_of
from tpe_train.model.args import ModelArgs
from tpe_train.model.build import build_model
from tpe_train.model.loss import label_smoothed_loss
from tpe_train.model.transformer import Transformer
from tpe_train.train import throughput
from tpe_train.train.build import build_optimizer, build_schedule

ROOT = Path(__file__).resolve().parents[1]
PAD, BOS, EOS = PAD_ID, BOS_ID, EOS_ID
SEED = 1234
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# ------------------------------------------------------------------------------------ timing


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that a wall-clock interval covers it (GPU kernels are
    asynchronous; on the CPU this does nothing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def interleave(
    rows: Sequence[Any],
    warmup: int,
    steps: int,
    device: torch.device,
    label: str,
    *,
    clock: Callable[[], float] = time.perf_counter,
    collect: Literal["never", "after warm-up", "every step"] = "after warm-up",
    rotate: bool = True,
    cpu_time: bool = False,
    quiet: bool = False,
) -> None:
    """Warm every row up (``row.warmup_steps`` untimed steps where the row sets it, else ``warmup``),
    then ``steps`` rounds of one timed ``row.step()`` per row, appended to ``row.times`` (seconds by
    ``clock``; with ``cpu_time`` also the process's CPU time to ``row.cpu_times``). ``rotate``: the
    order shifts by one every round. ``collect``: when the garbage collector runs (not inside a timed
    step). On a GPU with the default clock a step is timed by CUDA events recorded around it (the
    device's time from its first queued kernel to its last, idle gaps included)."""
    for row in rows:
        n = getattr(row, "warmup_steps", None)
        t0 = time.perf_counter()
        for _ in range(warmup if n is None else n):
            row.step()
        if not quiet:
            progress(f"  [{label}] warmed up {row_label(row):<28} in {time.perf_counter() - t0:7.1f} s")
    if collect == "after warm-up":
        gc.collect()
    for r in range(steps):
        t_round = time.perf_counter()
        shift = r % len(rows) if rotate else 0
        for row in [*rows[shift:], *rows[:shift]]:
            if collect == "every step":
                gc.collect()
            sync(device)
            c0 = time.process_time()
            if device.type == "cuda" and clock is time.perf_counter:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                row.step()
                end.record()
                end.synchronize()
                row.times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = clock()
                row.step()
                sync(device)
                row.times.append(clock() - t0)
            if cpu_time:
                row.cpu_times.append(time.process_time() - c0)
        if not quiet:
            progress(f"  [{label}] round {r + 1}/{steps} in {time.perf_counter() - t_round:7.1f} s")


def row_label(row: Any) -> str:
    return f"{row.name} {getattr(row, 'dtype', '')}".strip()


@dataclass
class FnRow:
    """A row of ``interleave`` that calls a function; ``result``: what its last call returned."""

    name: str
    fn: Callable[[], Any]
    warmup_steps: int | None = None
    times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)
    result: Any = None

    def step(self) -> None:
        self.result = self.fn()


def p90(values: Sequence[float]) -> float:
    """The 90th percentile (linear interpolation; the value itself for one sample)."""
    return float(np.percentile(np.asarray(values, dtype=float), 90))


def summary(times: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """Median, min and 90th percentile of ``times``, each multiplied by ``scale``."""
    return {
        "median": scale * statistics.median(times),
        "min": scale * min(times),
        "p90": scale * p90(times),
    }


# -------------------------------------------------------------------------------------- peak


def gemm_shapes(args: ModelArgs, device: torch.device | None = None, rows: int = 4096) -> list[Any]:
    """The model's own GEMM shapes (M, K, N) at ``rows`` tokens: the FFN's two products, the
    attention projections, the output layer; on a GPU (``device``) also an 8,192-cube, as a GPU
    comes near its peak only on large products."""
    d, f, v = args.d_model, args.ffn_dim, args.vocab_size
    shapes = [(rows, d, f), (rows, f, d), (rows, d, d), (rows, d, v)]
    return shapes if device is None or device.type == "cpu" else [*shapes, (8192, 8192, 8192)]


class PeakRow:
    """The GEMM peaks (``throughput.Peak``: every kernel on ``shapes``) per dtype, a row of the
    interleaved rounds: each step samples every kernel and shape ``reps`` times. Warmed up by its
    constructor (``warmup_steps`` 0); ``warmup_steps=None`` takes the rounds' warm-up steps, whose
    samples then count too."""

    def __init__(
        self,
        dtypes: Sequence[str],
        device: torch.device,
        shapes: Sequence[tuple[int, int, int]],
        reps: int,
        native_bf16: bool = True,
        name: str = "gemm-peak",
        warmup_steps: int | None = 0,
    ) -> None:
        self.name, self.reps, self.warmup_steps = name, reps, warmup_steps
        self.times: list[float] = []
        self.peaks = {
            dt: throughput.Peak(
                DTYPES[dt], device, throughput.gemm_kernels(DTYPES[dt], device, native_bf16), list(shapes)
            )
            for dt in dtypes
        }

    def step(self) -> None:
        for peak in self.peaks.values():
            peak.sample(self.reps)

    def result(self) -> dict[str, Any]:
        """Per dtype: median GFLOP/s per shape and kernel, and the peak = the best of them."""
        out = {}
        for dt, peak in self.peaks.items():
            table = peak.table(statistics.median)
            best = max((g, f"{kernel} {shape}") for shape, row in table.items() for kernel, g in row.items())
            out[dt] = {"per_shape_gflops": table, "peak_gflops": best[0], "peak_at": best[1]}
        return out


# ---------------------------------------------------------------------------- models, batches

#: the shape of bench_train.py, bench_translate.py and profile_step.py (one issue's): d_model 256, 4
#: heads, FFN 1024, 3 + 3 layers, a shared vocabulary of 8,000 with tied embeddings, dropout 0.1
BENCH_SHAPE = [
    "model.d_model=256",
    "model.n_heads=4",
    "model.ffn_dim=1024",
    "model.encoder_layers=3",
    "model.decoder_layers=3",
    "model.dropout=0.1",
    "model.position.max_positions=1024",
    "data.vocab_size=8000",
]
#: every small mode's model (``--smoke``), over ``BENCH_SHAPE`` or a script's preset: the preset's other
#: settings stay, so that a config change which breaks a documented command breaks its small mode too
SMOKE_MODEL = [
    "model.d_model=32",
    "model.n_heads=2",
    "model.ffn_dim=64",
    "model.encoder_layers=1",
    "model.decoder_layers=1",
]
SMOKE_SHAPE = [*SMOKE_MODEL, "data.vocab_size=400"]  # and a vocabulary that trains in milliseconds


def bench_config(smoke: bool = False) -> Config:
    """The configuration of ``BENCH_SHAPE`` (``SMOKE_SHAPE`` over it with ``smoke``)."""
    return load_config(None, [*BENCH_SHAPE, *(SMOKE_SHAPE if smoke else [])])


def model_args(cfg: Config, kind: str | None = None, vocab: int | None = None) -> ModelArgs:
    """``cfg.model.args`` with the encoding ``kind`` (default: the config's) over ``vocab`` words
    (default ``data.vocab_size``)."""
    model = cfg.model
    if kind is not None:  # validated again: an encoding may not fit the shape (rope, odd head width)
        fields = model.model_dump()
        model = type(model).model_validate({**fields, "position": {**fields["position"], "kind": kind}})
    return model_args_of(model, vocab or cfg.data.vocab_size)


def build(
    cfg: Config,
    kind: str | None = None,
    vocab: int | None = None,
    device: torch.device | str = "cpu",
    seed: int = SEED,
) -> Transformer:
    """The model the config describes (``model_args``), seeded, on ``device``."""
    return build_model(model_args(cfg, kind, vocab), device, seed)


@dataclass
class Batch:
    src: Tensor  # (B, Ls) right-padded
    tgt_in: Tensor  # (B, Lt) BOS + target
    tgt_out: Tensor  # (B, Lt) target + EOS
    ntok: int  # non-pad target tokens

    @classmethod
    def of(cls, batch: Any) -> Batch:
        """From the trainer's ``tpe_train.data.batching.Batch``."""
        return cls(batch.src, batch.tgt_in, batch.tgt_out, batch.target_tokens)


def padded(rows: Sequence[Tensor], length: int | None = None) -> Tensor:
    """(len(rows), length) right-padded with PAD; ``length`` defaults to the longest row."""
    out = torch.full((len(rows), length or max(r.numel() for r in rows)), PAD, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


def to_batch(src: Sequence[Tensor], tgt: Sequence[Tensor], device: torch.device) -> Batch:
    """A batch of source rows (as given) and target rows (BOS + target in, target + EOS out)."""
    bos, eos = torch.tensor([BOS]), torch.tensor([EOS])
    tgt_in = padded([torch.cat((bos, t)) for t in tgt])
    tgt_out = padded([torch.cat((t, eos)) for t in tgt])
    ntok = int((tgt_out != PAD).sum())
    return Batch(padded(src).to(device), tgt_in.to(device), tgt_out.to(device), ntok)


@dataclass(frozen=True)
class Uniform:
    """``count`` batches of ``size`` sentences whose source and target lengths are uniform in [lo, hi],
    one sentence at ``hi`` so that every batch pads to the same shape; random ids (``first_id`` up)."""

    size: int = 128
    count: int = 4
    lo: int = 24
    hi: int = 36
    first_id: int = 3

    def _lengths(self, gen: torch.Generator, n: int) -> list[int]:
        lengths = torch.randint(self.lo, self.hi + 1, (n,), generator=gen)
        lengths[int(torch.randint(n, (1,), generator=gen))] = self.hi
        return lengths.tolist()

    def _sentences(self, gen: torch.Generator, n: int, vocab: int) -> list[Tensor]:
        return [
            torch.randint(self.first_id, vocab, (length,), generator=gen) for length in self._lengths(gen, n)
        ]

    def batches(self, vocab: int, seed: int, device: torch.device) -> list[Batch]:
        gen = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(self.count):
            src = self._sentences(gen, self.size, vocab)
            out.append(to_batch(src, self._sentences(gen, self.size, vocab), device))
        return out

    def sources(self, vocab: int, n: int, seed: int, device: torch.device) -> Tensor:
        """``n`` padded source sentences (no EOS), of their own seed."""
        return padded(self._sentences(torch.Generator().manual_seed(seed), n, vocab), self.hi).to(device)


SMOKE_BATCHES = Uniform(size=8, count=2, lo=4, hi=8)  # bench_train.py's and profile_step.py's --smoke


def length_batches(
    cfg: Config,
    src_len: np.ndarray,
    tgt_len: np.ndarray,
    n: int,
    device: torch.device,
    max_tokens: int | None = None,
    first_id: int = 4,
) -> list[Batch]:
    """``n`` token batches of the given lengths (EOS included) cut as training cuts them (at most
    ``max_tokens``, default ``data.max_tokens``, padded source + target tokens, sorted by length),
    taken at evenly spaced quantiles of their padded size; random ids below ``data.vocab_size``."""
    vocab = cfg.data.vocab_size
    cut = token_batches(src_len, tgt_len, max_tokens or cfg.data.max_tokens, seed=1)
    cut.sort(key=lambda idx: int(src_len[idx].max() + tgt_len[idx].max()))
    picks = (
        [cut[round(q * (len(cut) - 1))] for q in np.linspace(0.1, 0.9, n)] if n > 1 else [cut[len(cut) // 2]]
    )
    gen = torch.Generator().manual_seed(SEED)
    out = []
    for idx in picks:
        src, tgt = [], []
        for i in idx:
            s, t = int(src_len[i]), int(tgt_len[i])
            words = torch.randint(first_id, vocab, (s - 1,), generator=gen)
            src.append(torch.cat((words, torch.tensor([EOS]))))
            tgt.append(torch.randint(first_id, vocab, (t - 1,), generator=gen))
        out.append(to_batch(src, tgt, device))
    return out


@contextlib.contextmanager
def saved_bytes(device: torch.device) -> Iterator[dict[int, int]]:
    """Bytes of the CPU tensors autograd saves for the backward pass inside the block, per storage
    (the CPU allocator keeps no peak): ``sum(d.values())`` of the dict it yields."""
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        if t.device.type == "cpu":
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


@dataclass
class Optimization:
    """An optimizer and its learning-rate schedule, stepped together."""

    opt: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler

    def step(self) -> None:
        self.opt.step()
        self.schedule.step()


def trainer_optimizer(model: nn.Module, train: TrainConfig) -> Optimization:
    """The trainer's optimizer and schedule (``tpe_train.train.build``) over ``model``'s parameters, with
    the ``train`` section's settings: fused AdamW, betas, eps, weight decay, inverse-sqrt warmup."""
    opt = build_optimizer(model, train)
    return Optimization(opt, build_schedule(opt, train))


class TrainRow:
    """One training step of a model on its batches (cycled): forward (a tpe_train ``Transformer`` or a
    Hugging Face encoder-decoder), label-smoothed loss on the logits (the trainer's, HF rows included,
    never HF's ``labels=``) with the trainer's gradient factor, backward, optimizer step; bf16 autocast
    around forward + loss for dtype bf16. ``train``: the config whose optimizer and schedule the step
    takes (``trainer_optimizer``); ``optimization``: one already built (a model shared by rows).
    ``memory``: record each step's memory (GPU: peak allocated; CPU: ``saved_bytes``)."""

    def __init__(
        self,
        name: str,
        model: nn.Module,
        batches: Sequence[Batch],
        device: torch.device,
        train: TrainConfig,
        dtype: str = "fp32",
        epsilon: float = 0.1,
        optimization: Optimization | None = None,
        memory: bool = False,
    ) -> None:
        self.name, self.dtype, self.model, self.batches = name, dtype, model, list(batches)
        self.device, self.epsilon, self.record_memory = device, epsilon, memory
        self.model.to(device).train()
        self.hf = not isinstance(model, Transformer)
        self.optimization = optimization if optimization is not None else trainer_optimizer(model, train)
        self.opt = self.optimization.opt
        self.times: list[float] = []
        self.losses: list[float] = []
        self.memory: list[int] = []
        self._step = 0

    def before_step(self) -> None:
        """Hook: what a row changes on a model shared with other rows (backend, compilation)."""

    def logits(self, b: Batch) -> Tensor:
        if self.hf:  # a Hugging Face encoder-decoder's training forward, no cache
            mask = (b.src != PAD_ID).long()
            out = self.model(
                input_ids=b.src, attention_mask=mask, decoder_input_ids=b.tgt_in, use_cache=False
            )
            return out.logits
        return self.model(b.src, b.tgt_in)  # type: ignore[no-any-return]

    def step(self) -> None:
        self.before_step()
        b = self.batches[self._step % len(self.batches)]
        self._step += 1
        self.opt.zero_grad(set_to_none=True)
        bf16 = self.dtype == "bf16"
        cast = torch.autocast(self.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        cuda = self.record_memory and self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        hooks = saved_bytes(self.device) if self.record_memory and not cuda else contextlib.nullcontext({})
        with cast, hooks as saved:
            logits = self.logits(b)
            scale = 1.0 / b.ntok  # the gradient's factor, passed as the trainer passes it
            loss, _, ntok = label_smoothed_loss(logits, b.tgt_out, PAD, self.epsilon, scale)
        (loss * scale).backward()
        self.optimization.step()
        self.losses.append(float(loss.detach()) / int(ntok))
        if self.record_memory:
            self.memory.append(torch.cuda.max_memory_allocated(self.device) if cuda else sum(saved.values()))


def n_params(model: nn.Module) -> int:
    """Parameters, each shared one (tied embeddings) once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


# ------------------------------------------------------------------------------------- memory


def resident() -> dict[str, int]:
    """This process's resident set now (``VmRSS``) and at its peak (``VmHWM``), bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def added_peak_rss(fn: Callable[[], Any]) -> dict[str, float]:
    """Wall time of ``fn`` and the most memory it added to this process at any moment (``VmHWM``
    reset to ``VmRSS`` through ``/proc/self/clear_refs``). Free heap memory goes back to the system
    first (else a call reusing it would look free of cost)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = resident()["VmRSS"]
    start = time.perf_counter()
    fn()
    wall = time.perf_counter() - start
    return {"wall_s": wall, "peak_extra_b": resident()["VmHWM"] - before}


def pss(pid: int) -> tuple[int, int]:
    """(PSS, anonymous PSS) of one process in bytes, from the kernel's /proc/PID/smaps_rollup."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Pss", "Pss_Anon"):
                fields[key] = int(rest.split()[0]) * 1024
    return fields["Pss"], fields["Pss_Anon"]


def tree_memory(pid: int) -> tuple[int, int]:
    """(PSS, anonymous PSS) summed over a process and its children. PSS splits each shared page among
    the processes that map it, so the sum is the tree's footprint (an RSS sum would count the pages
    forked workers share with their parent once per process). It includes the pages of memory-mapped
    files (the Arrow caches) that are resident, which the kernel can drop; the anonymous part (heaps,
    Python objects) is what it cannot, and what would run a node out of memory."""
    import psutil

    total = anon = 0
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(pid)
        for p in [proc, *proc.children(recursive=True)]:
            with contextlib.suppress(OSError, KeyError, psutil.Error):
                a, b = pss(p.pid)
                total, anon = total + a, anon + b
    return total, anon


@dataclass
class Sampled:
    wall_s: float
    peak_pss: int  # bytes
    peak_anon: int  # bytes
    out: str  # stdout and stderr
    returncode: int


def run_sampled(
    cmd: list[str],
    env: dict[str, str],
    preexec_fn: Callable[[], None] | None = None,
    every: float = 1.0,
    cwd: Path | None = None,
) -> Sampled:
    """Run ``cmd`` (in ``cwd``), sampling its process tree's memory (``tree_memory``) every ``every``
    seconds: reading smaps_rollup walks the page tables (~40 ms a process)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=preexec_fn,
        cwd=cwd,
    )
    peak = [0, 0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            now = tree_memory(proc.pid)
            peak[:] = [max(peak[0], now[0]), max(peak[1], now[1])]
            done.wait(every)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    out, _ = proc.communicate()
    done.set()
    watcher.join()
    return Sampled(time.perf_counter() - start, peak[0], peak[1], out, proc.returncode)


class CgroupUnavailable(RuntimeError):
    """This machine gives no memory cgroup to make."""


@dataclass
class MemoryLimit:
    """A memory cgroup of its own for child processes (Linux, cgroup v2 or v1 with a writable memory
    controller): the kernel keeps the group's resident memory, mapped file pages included, under
    ``limit`` bytes by dropping reclaimable pages, and kills a process only when what cannot be dropped
    (anonymous memory) would exceed it. ``peak()`` is the group's high-water mark, ``killed()`` its count
    of out-of-memory kills."""

    folder: Path
    v2: bool

    @classmethod
    def make(cls, limit: int, name: str) -> MemoryLimit:
        own = Path("/proc/self/cgroup").read_text().splitlines()
        v2 = not any(":memory:" in line for line in own)
        ours = [line.split(":", 2) for line in own]  # hierarchy-id:controllers:path
        rel = next(path for _, controllers, path in ours if controllers == ("" if v2 else "memory"))
        base = Path("/sys/fs/cgroup") if v2 else Path("/sys/fs/cgroup/memory")
        folder = base / rel.lstrip("/") / name
        try:
            folder.mkdir(exist_ok=True)
            (folder / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(limit))
        except OSError as err:
            raise CgroupUnavailable(
                f"cannot make the memory cgroup {folder} ({err}); a memory limit needs a writable memory "
                "controller (root in most containers): run without --memory-limit"
            ) from None
        return cls(folder, v2)

    def enter(self) -> None:
        """A ``preexec_fn``: the child joins the group before it runs anything."""
        (self.folder / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int:
        return int((self.folder / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")).read_text())

    def killed(self) -> int:
        name = "memory.events" if self.v2 else "memory.oom_control"
        fields = dict(line.split() for line in (self.folder / name).read_text().splitlines())
        return int(fields.get("oom_kill", 0))

    def remove(self) -> None:
        self.folder.rmdir()


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# ------------------------------------------------------------------------------------- output


def loadavg() -> tuple[float, float, float] | None:
    return os.getloadavg() if hasattr(os, "getloadavg") else None


def environment(device: torch.device, **extra: Any) -> dict[str, Any]:
    """What a figure depends on besides the code: versions, threads, processor, device, load."""
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "loadavg_at_start": loadavg(),
        **extra,
    }


def jsonable(value: Any) -> Any:
    """Paths as strings (argparse namespaces hold them), recursively."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def write_json(path: Path | None, payload: dict[str, Any]) -> None:
    """Write every number to ``path`` (nothing without one) and say so."""
    if path is None:
        return
    path.write_text(json.dumps(jsonable(payload), indent=2))
    print(f"wrote {path}")


def run_checked(
    cmd: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT, tail: int = 4000
) -> subprocess.CompletedProcess[str]:
    """Run a command to completion, output captured; exit with its last ``tail`` characters of
    stderr if it fails."""
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-tail:]}")
    return proc


def accelerate_cmd(config_file: Path) -> list[str]:
    """``accelerate launch --config_file FILE``, by the running interpreter."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file)]


def tb_scalars(run_dir: Path, tag: str) -> list[float]:
    """The values of one scalar of a run's TensorBoard events, in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    return [e.value for e in acc.Scalars(tag)]


def parse_with_smoke(
    parser: argparse.ArgumentParser, argv: list[str] | None, smoke: dict[str, Any]
) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with a ``--smoke`` flag: the script's small mode, which a CI smoke
    test runs. With ``--smoke`` the defaults ``smoke`` apply (flags given still win)."""
    parser.add_argument(
        "--smoke", action="store_true", help=f"small mode, seconds on a CPU: defaults {smoke or 'unchanged'}"
    )
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        parser.set_defaults(**smoke)
    return parser.parse_args(argv)


def shared_data_stub(directory: Path, pairs: int = 60) -> Path:
    """A tiny stand-in of the shared data folder (``../shared/data``) in its layout, generated text, for
    the small modes: ``opennmt-toy-ende/{src,tgt}-train.txt``, ``newstest2014-en-de/newstest2014.{en,de}``
    and ``multi30k/train.{en,de}``. Returns ``directory``."""
    toy, news = directory / "opennmt-toy-ende", directory / "newstest2014-en-de"
    write_pairs(toy / "src-train.txt", toy / "tgt-train.txt", pairs, seed=1)
    write_pairs(news / "newstest2014.en", news / "newstest2014.de", pairs, seed=2)
    write_pairs(directory / "multi30k" / "train.en", directory / "multi30k" / "train.de", pairs, seed=3)
    return directory


def write_pairs(src: Path, tgt: Path, n: int, seed: int) -> None:
    """``n`` generated sentence pairs (the embedded synthetic grammar), one a line, as two files."""
    from tpe_train.data.synthetic import generate

    pairs = generate(n, seed=seed)
    for side, path in enumerate((src, tgt)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(pair[side] + "\n" for pair in pairs), encoding="utf-8")
