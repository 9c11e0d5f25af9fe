"""``tpe-data check`` names the files a corpus needs, the ones found, lines per side and each problem
with its fix, and exits non-zero on a problem; the own-corpus preset and the demo's warning."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from tpe_train.config import load_config
from tpe_train.data.check import check_corpus, scan_file, suggested_vocab
from tpe_train.data.cli import main
from tpe_train.run.logs import configure


def _write(root: Path, files: dict[str, bytes]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (root / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    return root


GOOD = {
    "train.en": b"a house\nthe cat\n",
    "train.de.gz": b"ein haus\ndie katze\n",
    "validation.en": b"a dog\n",
    "validation.de": b"ein hund\n",
    "test.en": b"a tree\n",
    "test.de": b"ein baum\n",
}


def _cfg(root: Path, *extra: str):  # type: ignore[no-untyped-def]
    return load_config("own_corpus", [f"data.path={root}", *extra]).data


def test_a_clean_corpus_has_no_problem_and_exit_status_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _write(tmp_path / "c", GOOD)
    report = check_corpus(_cfg(root))
    assert report.problems == [] and report.train_pairs == 2
    assert f"  found {root / 'train.de.gz'}: 2 lines" in report.lines
    assert "validation (data.valid_split): expects validation.en and validation.de" in report.lines
    assert main(["check", "--preset", "own_corpus", f"data.path={root}"]) == 0
    out = capsys.readouterr().out
    assert (
        "no problems found" in out and "a joint BPE of about 4,000 (data.vocab_size=4000; now 32000)" in out
    )


def test_every_problem_is_named_with_its_fix_and_the_exit_status_is_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = {
        **GOOD,
        "train.en": b"\xef\xbb\xbfa house\rthe cat\n\nthird\n",  # BOM, lone \r, an empty line
        "train.de.gz": b"ein haus\ndie \xe4 katze\n",  # Latin-1, one line short
        "valid.en": b"x\n",
        "valid.de": b"y\n",
    }
    del files["validation.en"], files["validation.de"]
    root = _write(tmp_path / "c", files)
    problems = {
        (Path(p.where).name, p.what.split(" (")[0].split(";")[0], p.stops)
        for p in check_corpus(_cfg(root)).problems
    }
    assert problems == {
        ("train.en", "starts with a byte-order mark", False),
        ("train.en", "1 line is holding a carriage return", False),
        ("train.en", "1 line is empty or blank", False),
        ("train.de.gz", "1 line is not UTF-8", True),
        (
            "train.de.gz",  # "<dir>/train.en and <dir>/train.de.gz"
            "3 lines against 2: the sides are not line-aligned",
            True,
        ),
        ("validation.en", "not found", True),
        ("validation.de", "not found", True),
    }
    assert main(["check", "--preset", "own_corpus", f"data.path={root}"]) == 1
    err = capsys.readouterr().err
    assert (
        "set data.valid_split to the name its files start with; splits with both languages there: "
        "test, train, valid" in err
    )
    assert "Fix: convert the file: iconv" in err and "tr -d '\\r'" in err and "7 problems" in err
    # replace makes bad bytes a warning, not a stop
    stops = [p for p in check_corpus(_cfg(root, "data.bad_utf8=replace")).problems if "not UTF-8" in p.what]
    assert [p.stops for p in stops] == [False]


def test_scan_counts_lines_as_the_readers_do(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes("a\r\nb\rc\n\u2028d\n".encode())
    scan = scan_file(path)
    assert (scan.lines, scan.lone_cr, scan.first_lone_cr, scan.empty, scan.bom) == (3, 1, 2, 0, False)


def test_suggested_vocabulary_grows_with_the_corpus() -> None:
    sizes = [suggested_vocab(n) for n in (1_000, 100_000, 500_000, 2_000_000, 36_000_000)]
    assert sizes == sorted(sizes) and sizes[0] == 4000 and sizes[-1] == 32_000


def test_own_corpus_preset_is_the_base_model_on_text_files(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TPE_CORPUS", raising=False)
    cfg = load_config("own_corpus")
    base = load_config("wmt14_en_de_base")
    assert cfg.model == base.model and cfg.train == base.train
    assert (cfg.data.corpus, cfg.data.path, cfg.data.valid_split) == ("text", "corpus", "validation")
    monkeypatch.setenv("TPE_CORPUS", "/data/mine")
    assert load_config("own_corpus").data.path == "/data/mine"


def test_the_demo_preset_warns_when_given_a_corpus(capsys: pytest.CaptureFixture[str]) -> None:
    configure("tpe-test")
    load_config("demo")
    assert "demo's model" not in capsys.readouterr().err
    load_config("demo", ["data.corpus=text", "data.path=corpus"])
    err = capsys.readouterr().err
    assert "trains the demo's model on it (d_model 128" in err and "--preset own_corpus" in err
    load_config("own_corpus", ["data.path=corpus"])
    assert "demo's model" not in capsys.readouterr().err


@pytest.mark.integration
def test_the_command_exits_1_on_a_problem_and_0_without(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = _write(tmp_path / "c", GOOD)
    cmd = [sys.executable, "-m", "tpe_train.data.cli", "check", "--preset", "own_corpus", f"data.path={root}"]
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "tpe-data: no problems found" in ok.stdout, ok.stderr
    (root / "test.de").write_bytes(b"ein baum\n\xe9\n")
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert "test.en and" in bad.stderr
    assert "test.de: 1 line against 2: the sides are not line-aligned" in bad.stderr


def test_a_damaged_gzip_side_is_a_problem_naming_the_file(tmp_path: Path) -> None:
    root = _write(tmp_path / "c", GOOD)
    whole = (root / "train.de.gz").read_bytes()
    (root / "train.de.gz").write_bytes(whole[:-6])  # cut short: the stream has no end
    report = check_corpus(_cfg(root))
    (problem,) = [p for p in report.problems if p.where == str(root / "train.de.gz")]
    assert problem.stops and "not a whole gzip file" in problem.what and "gzip -t" in problem.fix
    assert report.train_pairs == 0  # the split is not counted
