"""The one logging set-up (tpe_train/run/logs.py): who prints what, where, and the run's log file."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tpe_train.run import logs

log = logging.getLogger("tpe_train.test")


def test_rank0_shows_progress_on_stdout_and_warnings_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure("tpe-x", rank=0)
    log.info("step 1")
    log.debug("hidden")
    log.warning("careful")
    logging.getLogger("__main__").info("as python -m runs a command")
    out, err = capsys.readouterr()
    assert out == "tpe-x: step 1\ntpe-x: as python -m runs a command\n"
    assert err == "tpe-x: warning: careful\n"


def test_other_ranks_show_warnings_only_with_their_rank(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure("tpe-x", rank=3)
    log.info("step 1")
    log.error("broken")
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "tpe-x [rank 3]: error: broken\n"


@pytest.mark.parametrize(
    ("quiet", "verbose", "shown"), [(True, False, ["w"]), (False, True, ["d", "i", "w"])]
)
def test_quiet_and_verbose(
    capsys: pytest.CaptureFixture[str], quiet: bool, verbose: bool, shown: list[str]
) -> None:
    logs.configure("tpe-x", rank=0, verbosity=logs.verbosity(quiet, verbose))
    log.debug("d")
    log.info("i")
    log.warning("w")
    out, err = capsys.readouterr()
    lines = (out + err).splitlines()
    assert [line.split(": ")[-1] for line in lines] == shown


def test_info_can_go_to_stderr_for_a_command_whose_stdout_is_its_product(
    capsys: pytest.CaptureFixture[str],
) -> None:
    logs.configure("tpe-translate", rank=0, info_stream="stderr")
    log.info("loaded")
    log.warning("careful")
    print("a translation")  # the product, on stdout alone
    out, err = capsys.readouterr()
    assert out == "a translation\n"
    assert err == "tpe-translate: loaded\ntpe-translate: warning: careful\n"
    with pytest.raises(ValueError, match="info_stream"):
        logs.configure("tpe-translate", info_stream="stdrr")


def test_configure_twice_prints_once(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure("tpe-a", rank=0)
    logs.configure("tpe-b", rank=0)
    log.info("once")
    assert capsys.readouterr().out == "tpe-b: once\n"


def test_the_log_file_keeps_every_level_with_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure("tpe-x", rank=0, verbosity=logs.QUIET)
    handler = logs.add_file(tmp_path / "run" / "train.log", rank=2)
    log.debug("detail")
    log.info("progress")
    logs.remove_file(handler)
    log.info("after")
    text = (tmp_path / "run" / "train.log").read_text()
    assert "rank 2 DEBUG tpe_train.test: detail" in text
    assert "rank 2 INFO tpe_train.test: progress" in text
    assert "after" not in text
    assert capsys.readouterr().out == ""
