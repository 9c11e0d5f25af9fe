"""Process-wide settings of a CPU run, made once at start-up: the training GEMMs' kernels and glibc's
allocator (measurements: docs/benchmarks.md)."""

from __future__ import annotations

import ctypes
import logging
import os

import torch

from tpe_train.config import ConfigError
from tpe_train.model.kernels import set_cpu_gemm

log = logging.getLogger(__name__)


def configure_cpu(cpu_gemm: str, device: torch.device) -> None:
    """Process-wide settings of a CPU run: the training GEMMs' kernels (``train.cpu_gemm``), and
    glibc's allocator told to keep freed memory instead of returning it to the system. Otherwise
    every large tensor of a step (activations, the (tokens, vocabulary) logits and their gradient)
    is a fresh ``mmap`` whose pages fault in one by one at first touch: converting 4,736 x 8,000
    logits to bf16 took 62 ms into a new tensor and 14 ms into a reused one, and a training step of
    the benchmark's shape 5% (fp32) to 15% (bf16) less CPU time with the setting. This is what
    PyTorch's CPU tuning guides get from jemalloc or tcmalloc."""
    try:
        set_cpu_gemm(cpu_gemm)
    except ValueError as err:  # $TPE_CPU_GEMM names no mode
        raise ConfigError(str(err)) from None
    if device.type == "cpu":
        keep_freed_memory()


def keep_freed_memory() -> bool:
    """glibc ``mallopt``: no ``mmap`` for large blocks, no trimming of the heap; False elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))


def intra_op_threads(asked: int, local_ranks: int, cores: int, warn: bool = True) -> int:
    """The torch intra-op threads of one of ``local_ranks`` processes on a node whose launch may use
    ``cores`` cores: ``asked`` (``train.threads``; 0 leaves torch's default), but no more than the
    node's share of one process. OpenMP threads wait for each other at every parallel region, and a
    thread whose core another process holds makes the rest wait: the demo's ``threads: 2`` in both ranks
    of a 2-process launch on 2 cores ran 4 threads there (docs/training.md has the cost). ``torchrun``
    sets OMP_NUM_THREADS=1 for the same reason; a larger ``train.threads`` would undo it. ``warn``: say
    so (one process of a node does, not each of its ranks)."""
    share = max(1, cores // max(1, local_ranks))
    if asked <= share:
        return asked
    if warn:
        log.warning(
            "train.threads=%d in each of %d processes on this node would run %d threads on %d cores, and "
            "threads that wait for cores slow every step; using %d per process. Set train.threads to at "
            "most the cores per process (%d) to silence this",
            asked, local_ranks, asked * local_ranks, cores, share, share,
        )  # fmt: skip
    return share


def set_threads(asked: int) -> None:
    """Set the intra-op threads of this process from ``train.threads`` (see ``intra_op_threads``), the
    node's processes counted from the launcher's LOCAL_WORLD_SIZE and its cores from the affinity mask
    (what Slurm's cgroup or ``taskset`` gives this process)."""
    if asked:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        first = os.environ.get("LOCAL_RANK", "0") == "0"
        torch.set_num_threads(intra_op_threads(asked, local, len(os.sched_getaffinity(0)), warn=first))
