"""Shared fixtures and marks. Helpers live in ``tests/support/`` (tiny models, the distributed harness,
the local Slurm cluster)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.models import TINY_RUN

from tpe_train.model import kernels
from tpe_train.run import logs

# One intra-op thread in the test process: the unit tests' models are tiny, and a second thread costs
# more in waits than it saves (test_model.py's 150 overfitting steps of a d=32 model: 1.4 s on one
# thread, 77 s on two with both cores busy). Tests of threading set their own count; the processes
# tests start keep their own setting (train.threads).
torch.set_num_threads(1)
# Token stores of every test (and of the processes tests start) go to a fresh temporary directory.
os.environ["TPE_DATA_CACHE"] = tempfile.mkdtemp(prefix="tpe-data-")
# No user's Slurm site file (~/.config/tpe-train/slurm.yaml) changes what `tpe-launch submit` renders here;
# the tests that read one point TPE_SLURM_CONFIG at their own.
os.environ["TPE_SLURM_CONFIG"] = ""


def pytest_configure(config: pytest.Config) -> None:
    """``TPE_CPU_GEMM=onednn`` or ``default`` runs the suite, and every process it starts, with that
    mode wherever ``train.cpu_gemm`` is ``auto`` (docs/testing.md); any other value stops here."""
    try:
        kernels.forced_cpu_gemm()
    except ValueError as err:
        raise pytest.UsageError(str(err)) from None


def pytest_report_header() -> str:
    return f"{kernels.CPU_GEMM_ENV}: {kernels.forced_cpu_gemm() or 'unset (auto follows the processor)'}"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_logging() -> Iterator[None]:
    """A command's ``main`` run in-process sets up logging for the whole process (its own handler, no
    propagation); undo that after each test so that the next test's ``caplog`` sees the records again."""
    yield
    for name in logs.ROOTS:
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if h.get_name() == "tpe-console"]:
            logger.removeHandler(handler)
        logger.propagate = True
        logger.setLevel(logging.NOTSET)


def _tiny_argv(root: Path, *overrides: str) -> list[str]:
    """``TINY_RUN`` writing its run to ``root/run`` and its token store to ``root/store``."""
    return [*TINY_RUN, *overrides, f"train.run_dir={root / 'run'}", f"data.store_dir={root / 'store'}"]


@pytest.fixture(scope="session")
def tiny_step(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real tiny run of one step, made once in this process and shared (read it, or copy it to change
    it): ``run/checkpoints/step-00000001``, ``run/checkpoint`` (its export) and the token store ``store``."""
    from tpe_train.train.cli import main as tpe_train

    root = tmp_path_factory.mktemp("tiny-step")
    assert tpe_train(_tiny_argv(root, "train.max_steps=1")) == 0
    return root


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real ``tpe-train`` run of the tiniest model (``TINY_RUN``, 2 steps, a checkpoint after each),
    made once for the whole session and shared by the files that read one: ``run/`` (checkpoints
    ``step-00000001`` and ``step-00000002``, the final export ``checkpoint``) and ``store/`` (its token
    store) under the returned folder. Tests copy what they change; only integration tests may ask
    for it (it starts a process)."""
    root = tmp_path_factory.mktemp("tiny-run")
    argv = _tiny_argv(root, "train.max_steps=2", "train.save_every=1")
    cmd = [sys.executable, "-m", "tpe_train.train", *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


# --------------------------------------------------------------------------------------------------
# Marks: `integration` for tests that run the project's commands in other processes (multi-process
# gloo, accelerate launch, Slurm, the console scripts), `slow` for in-process tests of several
# seconds. `python -m pytest -m "not integration and not slow"` is the fast unit subset; CI runs all.
# A test that starts one of the project's commands without the `integration` mark fails, so the
# subset stays what it claims to be.

_CURRENT: list[pytest.Item] = []
_PROJECT_COMMANDS = ("tpe_train", "tpe-", "accelerate", "sbatch", "srun", "benchmarks/", "dist_harness")


def _starts_project_command(args: object) -> bool:
    words = [args] if isinstance(args, str | bytes) else list(args)  # type: ignore[call-overload]
    text = " ".join(str(w) for w in words)
    return any(name in text for name in _PROJECT_COMMANDS)


_popen_init = subprocess.Popen.__init__


def _guarded_popen_init(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> None:
    item = _CURRENT[-1] if _CURRENT else None
    if item is not None and item.get_closest_marker("integration") is None and _starts_project_command(args):
        raise pytest.fail.Exception(
            f"{item.nodeid} starts {args!r} in another process but is not marked "
            "@pytest.mark.integration; mark it (or the module: pytestmark = pytest.mark.integration)"
        )
    _popen_init(self, args, *rest, **kw)


subprocess.Popen.__init__ = _guarded_popen_init  # type: ignore[method-assign]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    _CURRENT.append(item)
    try:
        return (yield)
    finally:
        _CURRENT.pop()
