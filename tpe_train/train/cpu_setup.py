"""Process-wide settings of a CPU run, made once at start-up: the training GEMMs' kernels and glibc's
allocator (measurements: docs/benchmarks.md)."""

from __future__ import annotations

import ctypes

import torch

from tpe_train.model.kernels import set_cpu_gemm


def configure_cpu(cpu_gemm: str, device: torch.device) -> None:
    """Process-wide settings of a CPU run: the training GEMMs' kernels (``train.cpu_gemm``), and
    glibc's allocator told to keep freed memory instead of returning it to the system. Otherwise
    every large tensor of a step (activations, the (tokens, vocabulary) logits and their gradient)
    is a fresh ``mmap`` whose pages fault in one by one at first touch: converting 4,736 x 8,000
    logits to bf16 took 62 ms into a new tensor and 14 ms into a reused one, and a training step of
    the benchmark's shape 5% (fp32) to 15% (bf16) less CPU time with the setting. This is what
    PyTorch's CPU tuning guides get from jemalloc or tcmalloc."""
    set_cpu_gemm(cpu_gemm)
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
