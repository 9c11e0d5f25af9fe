"""The benchmarks' memory cgroup (``harness.MemoryLimit``, behind ``bench_prepare.py --memory-limit``):
memory a process needs beyond the limit gets it killed, while mapped file pages beyond it (what a
memory-mapped Arrow corpus adds to RSS) are dropped by the kernel and the process goes on. Where the
machine gives no writable memory controller, the limit is refused with a message saying so."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
MIB = 2**20

CHILD = """
import mmap, sys
if sys.argv[1] == "anon":
    block = bytearray(300 * 2**20)  # touched: 300 MiB of anonymous memory
    print(len(block))
else:
    with open(sys.argv[2], "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        print(sum(m[i] for i in range(0, len(m), 4096)))  # every page of a 400 MiB file, mapped
"""


def run_in_group(tmp_path: Path, kind: str) -> tuple[int, int, int]:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from harness import CgroupUnavailable, MemoryLimit
    finally:
        sys.path.remove(str(BENCHMARKS))
    data = tmp_path / "mapped.bin"
    if kind == "mapped":
        with open(data, "wb") as f:
            for _ in range(400):
                f.write(b"\1" * MIB)
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # the child's reads fill its group
    try:
        group = MemoryLimit.make(200 * MIB, f"tpe-test-{kind}")
    except CgroupUnavailable as err:
        assert "run without --memory-limit" in str(err)
        return -1, -1, -1
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, kind, str(data)], preexec_fn=group.enter)
        return proc.returncode, group.peak(), group.killed()
    finally:
        group.remove()


def test_anonymous_memory_beyond_the_limit_is_killed(tmp_path: Path) -> None:
    code, peak, killed = run_in_group(tmp_path, "anon")
    if code != -1 or killed != -1:  # a machine with a memory controller
        assert (code, killed) == (-9, 1) and peak <= 200 * MIB


def test_mapped_file_pages_beyond_the_limit_are_dropped_and_the_run_goes_on(tmp_path: Path) -> None:
    code, peak, killed = run_in_group(tmp_path, "mapped")
    if code != -1 or killed != -1:
        assert (code, killed) == (0, 0) and 150 * MIB < peak <= 200 * MIB, peak / MIB  # it filled the group
