"""tpe-translate's length cap and what a stop partway keeps, on a tiny exported model whose encoding
(rotary) has no length limit of its own: a line of 100,000 tokens would need hundreds of GiB of
attention scores, so a quick, named error shows that it was never decoded."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tpe_train.ckpt.export import save_export
from tpe_train.config import load_config
from tpe_train.data.batching import model_args
from tpe_train.data.synthetic import generate
from tpe_train.data.tokenizer import encode, train_tokenizer
from tpe_train.evaluation.cli import MAX_SOURCE_LEN, translate_main
from tpe_train.model.build import build_model

TINY = ["model.position.kind=rope", "model.d_model=16", "model.n_heads=2", "model.ffn_dim=32",
        "model.encoder_layers=1", "model.decoder_layers=1", "train.threads=1", "eval.beam=1",
        "eval.max_len_a=0", "eval.max_len_b=3"]  # fmt: skip
GOOD = ["the small cat helps a river .", "a river helps the small cat .", "the dog sees a cat .",
        "a big dog helps the river .", "the cat sees the dog ."]  # fmt: skip


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Tokenizer]:
    """An untrained rope model over a real tokenizer, exported as training exports it."""
    pairs = generate(300, seed=3)
    tok = train_tokenizer([s for p in pairs for s in p], 120)
    cfg = load_config("demo", TINY)
    folder = tmp_path_factory.mktemp("limits") / "export"
    save_export(folder, build_model(model_args(cfg.model, tok.get_vocab_size())), cfg, tok, step=0)
    return folder, tok


def _long(tok: Tokenizer, tokens: int) -> str:
    unit = "the small cat sees a big dog "
    per = len(encode(tok, [unit.strip()])[0])
    line = (unit * (tokens // per + 1)).strip()
    assert len(encode(tok, [line])[0]) >= tokens
    return line


def _translations(ckpt: Path, lines: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    capsys.readouterr()
    src = ckpt.parent / "alone.src"
    src.write_text("".join(line + "\n" for line in lines))
    assert translate_main(["--checkpoint", str(ckpt), "-i", str(src)]) == 0
    return capsys.readouterr().out.splitlines()


def test_a_line_over_the_default_cap_stops_before_anything_is_decoded(
    export: tuple[Path, Tokenizer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, tok = export
    src, out = tmp_path / "in.src", tmp_path / "out.hyp"
    src.write_text(f"{GOOD[0]}\n{GOOD[1]}\n{_long(tok, 100_000)}\n{GOOD[2]}\n{_long(tok, 2000)}\n")
    out.write_text("an earlier output\n")
    start = time.perf_counter()
    assert translate_main(["--checkpoint", str(ckpt), "-i", str(src), "-o", str(out)]) == 2
    assert time.perf_counter() - start < 20  # 100,000 tokens were tokenised, never decoded
    err = capsys.readouterr().err
    assert f"{src} line 3 has " in err and f"more than --max-source-len {MAX_SOURCE_LEN:,}" in err
    assert "raise --max-source-len" in err and "--truncate" in err and "(1 more lines are longer too)" in err
    assert "Traceback" not in err and MAX_SOURCE_LEN == 1024
    assert out.read_text() == "an earlier output\n"  # nothing was translated, so nothing changes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.src", "out.hyp"]


def test_truncate_cuts_a_long_line_to_the_cap_and_translates_every_line(
    export: tuple[Path, Tokenizer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, tok = export
    expected = _translations(ckpt, GOOD[:2], capsys)
    long = _long(tok, 100_000)
    cut = _translations(ckpt, [tok.decode(encode(tok, [long])[0][:64])], capsys)
    src = tmp_path / "in.src"
    src.write_text(f"{GOOD[0]}\n{long}\n{GOOD[1]}\n")
    argv = ["--checkpoint", str(ckpt), "-i", str(src), "--max-source-len", "64", "--truncate"]
    assert translate_main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [expected[0], cut[0], expected[1]]
    assert "1 lines were truncated: lines 2" in captured.err


def test_a_bad_cap_is_refused(export: tuple[Path, Tokenizer], capsys: pytest.CaptureFixture[str]) -> None:
    ckpt, _ = export
    assert translate_main(["--checkpoint", str(ckpt), "--max-source-len", "0"]) == 2
    assert "--max-source-len must be at least 1" in capsys.readouterr().err


def test_a_long_line_on_stdin_keeps_the_lines_translated_before_it(
    export: tuple[Path, Tokenizer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    ckpt, tok = export
    expected = _translations(ckpt, GOOD[:4], capsys)
    out = tmp_path / "out.hyp"
    out.write_text("an earlier output\n")
    data = "".join(f"{line}\n" for line in [*GOOD[:4], GOOD[4], _long(tok, 200)]).encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    argv = ["--checkpoint", str(ckpt), "--buffer-lines", "2", "--max-source-len", "100", "-o", str(out)]
    assert translate_main(argv) == 2
    err = capsys.readouterr().err
    assert "<stdin> line 6 has " in err and "more than --max-source-len 100" in err and "--truncate" in err
    assert f"stopped after 4 input lines; their translations are kept in {out}.partial" in err
    assert (tmp_path / "out.hyp.partial").read_text().splitlines() == expected  # lines 5-6: one chunk
    assert out.read_text() == "an earlier output\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.hyp", "out.hyp.partial"]  # no temporary


@pytest.mark.integration
def test_an_interrupt_partway_keeps_what_was_written(export: tuple[Path, Tokenizer], tmp_path: Path) -> None:
    """The real command on a pipe: two lines translated and flushed, then SIGINT while it waits."""
    ckpt, _ = export
    out = tmp_path / "out.hyp"
    cmd = [sys.executable, "-m", "tpe_train.evaluation", "translate", "--checkpoint", str(ckpt),
           "--buffer-lines", "2", "-o", str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None
    proc.stdin.write(f"{GOOD[0]}\n{GOOD[1]}\n")
    proc.stdin.flush()
    tmp = tmp_path / f".out.hyp.tmp-{proc.pid}"
    deadline = time.monotonic() + 120
    while not (tmp.exists() and tmp.read_text().count("\n") == 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted after 2 input lines" in err and "Traceback" not in err
    assert (tmp_path / "out.hyp.partial").read_text().count("\n") == 2
    assert not out.exists() and not tmp.exists()


@pytest.mark.integration
def test_a_line_of_twenty_megabytes_costs_memory_in_proportion_to_the_cap(
    export: tuple[Path, Tokenizer], tmp_path: Path
) -> None:
    """About 10M tokens in one line: tokenising it whole takes over 3 GiB; only its head is tokenised."""
    ckpt, _ = export
    src = tmp_path / "in.src"
    src.write_text(f"{GOOD[0]}\n" + "the small cat sees a big dog " * 700_000 + "\n")
    run = (
        "import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
        "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); print(p.stderr)"
    )
    cmd = [sys.executable, "-c", run, sys.executable, "-m", "tpe_train.evaluation", "translate",
           "--checkpoint", str(ckpt), "-i", str(src)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    code, peak_kib = proc.stdout.split("\n", 1)[0].split()
    assert code == "2", proc.stdout
    assert f"{src} line 2 has at least " in proc.stdout and "more than --max-source-len 1,024" in proc.stdout
    print(f"peak RSS {int(peak_kib) // 1024} MiB")  # shown with -s
    assert int(peak_kib) < 1536 * 1024, f"peak RSS {int(peak_kib) // 1024} MiB"
