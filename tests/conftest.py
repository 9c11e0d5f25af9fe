"""Shared fixtures and marks. Helpers live in ``tests/support/`` (tiny models, the distributed harness,
the local Slurm cluster)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

# Token stores of every test (and of the processes tests start) go to a fresh temporary directory.
os.environ["TPE_DATA_CACHE"] = tempfile.mkdtemp(prefix="tpe-data-")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
