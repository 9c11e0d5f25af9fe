"""Process settings of a CPU run: the intra-op threads of each process of a launch."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from tpe_train.train.cpu_setup import intra_op_threads, set_threads


@pytest.mark.parametrize(
    ("asked", "local_ranks", "cores", "threads"),
    [
        (2, 1, 2, 2),  # one process: what it asks for
        (2, 2, 2, 1),  # the demo's 2 in each of 2 ranks on 2 cores: 1 each
        (3, 4, 2, 1),  # more processes than cores: still one thread each
        (8, 4, 16, 4),  # a 16-core node of 4 ranks: its share
        (4, 4, 16, 4),
        (0, 2, 2, 0),  # 0: torch's default (torchrun's OMP_NUM_THREADS=1) untouched
    ],
)
def test_threads_are_at_most_the_nodes_cores_per_process(
    asked: int, local_ranks: int, cores: int, threads: int, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="tpe_train"):
        assert intra_op_threads(asked, local_ranks, cores) == threads
    warned = [r.getMessage() for r in caplog.records]
    if threads < asked:
        assert len(warned) == 1 and f"train.threads={asked} in each of {local_ranks} processes" in warned[0]
        assert f"{asked * local_ranks} threads on {cores} cores" in warned[0] and "using" in warned[0]
    else:
        assert warned == []


def test_set_threads_counts_the_launchers_local_processes_and_this_process_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cores, before = len(os.sched_getaffinity(0)), torch.get_num_threads()
    try:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))
        set_threads(2 * cores)
        assert torch.get_num_threads() == 1
        monkeypatch.delenv("LOCAL_WORLD_SIZE")
        set_threads(cores)
        assert torch.get_num_threads() == cores
    finally:
        torch.set_num_threads(before)


def test_only_the_first_process_of_a_node_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tpe_train"):
        assert intra_op_threads(2, 2, 2, warn=False) == 1
    assert caplog.records == []
