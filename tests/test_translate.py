"""tpe-translate and tpe-eval on one small trained model (trained once for the module): translations
are the ones evaluation scored, line for line and in input order; n-best lists; bad, empty and over-long
lines; any test set scored as sacreBLEU's own command scores the same files; paired bootstrap tests."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from sacrebleu.metrics import BLEU
from sacrebleu.significance import PairedTest

from tpe_train.ckpt.export import load_export, save_export
from tpe_train.data.batching import model_args
from tpe_train.evaluation.cli import eval_main, translate_main
from tpe_train.evaluation.decoding import read_lines, token_batches
from tpe_train.evaluation.evaluate import EvalFiles, TestSet, concatenated, config_sets
from tpe_train.evaluation.metrics import paired_bootstrap
from tpe_train.model.build import build_model

# The demo preset at a small size, learned positions of 48 rows (so a long line is too long for it).
TINY = [
    "data.synthetic.train_size=3000",
    "data.synthetic.valid_size=20",
    "data.synthetic.test_size=150",
    "data.synthetic.long_size=10",
    "data.synthetic.probe_size=20",
    "data.synthetic.max_words=12",
    "data.synthetic.long_max_words=16",
    "data.vocab_size=200",
    "data.max_tokens=2048",
    "data.max_len=40",
    "model.position.kind=learned",
    "model.position.max_positions=48",
    "model.d_model=64",
    "model.ffn_dim=128",
    "model.encoder_layers=2",
    "model.decoder_layers=2",
    "train.max_steps=300",
    "train.warmup_steps=100",
    "train.lr=0.005",
    "train.valid_every=1000",
    "train.valid_bleu_size=0",
    "train.log_every=100",
    "train.progress=false",
    "train.threads=1",  # also for tpe-eval and tpe-translate: a tiny model, a loaded machine
    "eval.length_buckets=[6,12]",
    "eval.max_tokens=300",  # several batches for 150 test sentences
]
LONG = " ".join(["the small cat sees a big dog"] * 8) + " ."  # far more than 47 tokens


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run of a few hundred steps: its export, its evaluation's figures and hypotheses."""
    run = tmp_path_factory.mktemp("translate") / "run"
    cmd = [sys.executable, "-m", "tpe_train.train", "--preset", "demo", *TINY, f"train.run_dir={run}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run


@pytest.fixture(scope="session")
def test_files(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The model's test set as a source and a reference file."""
    _, cfg, _ = load_export(run_dir / "checkpoint")
    (test,) = config_sets(cfg.data)
    folder = tmp_path_factory.mktemp("files")
    src, ref = folder / "test.src", folder / "test.ref"
    src.write_text("".join(s + "\n" for s, _ in test.pairs))
    ref.write_text("".join(t + "\n" for _, t in test.pairs))
    return src, ref


@pytest.fixture(scope="session")
def evaluated(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[EvalFiles, str]:
    """``tpe-eval --split test,validation --out DIR``: what it kept in DIR, and the table it printed."""
    out = tmp_path_factory.mktemp("eval")
    table = io.StringIO()
    with contextlib.redirect_stdout(table):
        code = eval_main(
            ["--checkpoint", str(run_dir / "checkpoint"), "--split", "test,validation", "--out", str(out)]
        )
    assert code == 0
    return EvalFiles(out), table.getvalue()


@pytest.mark.integration
def test_translate_gives_what_evaluation_scored_for_a_file_and_for_stdin(
    run_dir: Path, test_files: tuple[Path, Path], evaluated: tuple[EvalFiles, str], tmp_path: Path
) -> None:
    ckpt, (src, _) = run_dir / "checkpoint", test_files
    scored = read_lines(evaluated[0].hypotheses("test"))
    assert scored == read_lines(EvalFiles(run_dir).hypotheses("test"))  # training's final evaluation
    assert len(scored) == 150 and len(set(scored)) > 100  # a model that translates, not one line
    out = tmp_path / "test.hyp"
    assert translate_main(["--checkpoint", str(ckpt), "-i", str(src), "-o", str(out)]) == 0
    assert read_lines(out) == scored
    proc = subprocess.run(
        [sys.executable, "-m", "tpe_train.evaluation", "translate", "--checkpoint", str(ckpt)],
        input=src.read_bytes(),
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert proc.stdout.decode().splitlines() == scored
    err = proc.stderr.decode()
    assert "150 sentences" in err and "sentences/s" in err and "output tokens/s" in err
    assert "sent/s" not in err and "%|" not in err  # no progress bar when piping


@pytest.mark.integration
def test_nbest_lists_are_sorted_and_begin_with_the_best(
    run_dir: Path, test_files: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "some.src"
    src.write_text("".join(line + "\n" for line in read_lines(test_files[0])[:12]))
    ckpt = str(run_dir / "checkpoint")
    assert translate_main(["--checkpoint", ckpt, "-i", str(src), "--beam", "4", "--progress"]) == 0
    captured = capsys.readouterr()
    best = captured.out.splitlines()
    assert "12/12" in captured.err and "sent/s" in captured.err  # the progress bar, forced on
    assert translate_main(["--checkpoint", ckpt, "-i", str(src), "--beam", "4", "--nbest", "3"]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 36 and all(len(row) == 3 for row in rows)
    for number in range(1, 13):
        entries = [(float(score), text) for n, score, text in rows if int(n) == number]
        assert len(entries) == 3
        scores = [score for score, _ in entries]
        assert scores == sorted(scores, reverse=True) and scores[0] < 0
        assert entries[0][1] == best[number - 1]
    assert translate_main(["--checkpoint", ckpt, "-i", str(src), "--beam", "2", "--nbest", "3"]) == 2
    assert "raise --beam to at least 3" in capsys.readouterr().err


@pytest.mark.integration
def test_empty_over_long_and_invalid_lines(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = str(run_dir / "checkpoint")
    good = ["the small cat helps a river .", "a river helps the small cat ."]
    src = tmp_path / "mixed.src"
    src.write_text(f"{good[0]}\n\n{LONG}\n{good[1]}\n")
    alone = tmp_path / "alone.src"
    alone.write_text("".join(g + "\n" for g in good))
    assert translate_main(["--checkpoint", ckpt, "-i", str(alone), "--greedy"]) == 0
    expected = capsys.readouterr().out.splitlines()
    # an empty line gives an empty line; the over-long one an empty line and a report naming it
    assert translate_main(["--checkpoint", ckpt, "-i", str(src), "--greedy"]) == 0
    captured = capsys.readouterr()
    assert captured.out.split("\n") == [expected[0], "", "", expected[1], ""]
    assert "line 3:" in captured.err and "--truncate" in captured.err and "Traceback" not in captured.err
    # --truncate translates what the learned table can represent
    assert translate_main(["--checkpoint", ckpt, "-i", str(src), "--greedy", "--truncate"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.split("\n")
    assert lines[2] != "" and [lines[0], lines[1], lines[3]] == [expected[0], "", expected[1]]
    assert "1 lines were truncated: lines 3" in captured.err
    # bytes that are not UTF-8: one message naming the line, nothing translated or written
    bad = tmp_path / "bad.src"
    bad.write_bytes(f"{good[0]}\n{good[1]}\n".encode() + b"caf\xe9 au lait\n")
    out = tmp_path / "bad.hyp"
    out.write_text("kept\n")
    assert translate_main(["--checkpoint", ckpt, "-i", str(bad), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{bad} line 3 is not UTF-8" in err and "Traceback" not in err
    assert out.read_text() == "kept\n"  # untouched, and no temporary file left beside it
    assert [p.name for p in tmp_path.iterdir() if "bad.hyp" in p.name] == ["bad.hyp"]


@pytest.mark.integration
def test_invalid_utf8_on_stdin_names_the_line(run_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    data = b"the small cat helps a river .\n\xff\xfe\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert translate_main(["--checkpoint", str(run_dir / "checkpoint"), "--buffer-lines", "1"]) == 2
    captured = capsys.readouterr()
    assert "<stdin> line 2 is not UTF-8" in captured.err
    assert len(captured.out.splitlines()) == 1  # the line before it was translated and written


def test_token_batches_hold_every_sentence_once_within_the_budget() -> None:
    lengths = [5, 30, 7, 7, 12, 90, 3, 30, 8]
    batches = token_batches(lengths, max_tokens=40, batch_size=3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(flat)  # cut from length-sorted order
    for batch in batches:
        assert len(batch) <= 3
        assert len(batch) == 1 or max(lengths[i] for i in batch) * len(batch) <= 40
    assert [5] in batches  # longer than the budget on its own: a batch of one


def _sacrebleu(ref: Path, hyp: Path) -> float:
    """sacreBLEU's own command on two files: the BLEU score."""
    cmd = [sys.executable, "-m", "sacrebleu", str(ref), "-i", str(hyp), "-m", "bleu", "-b", "-w", "6"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return float(proc.stdout.strip())


@pytest.mark.integration
def test_splits_and_files_score_as_the_sacrebleu_command(
    run_dir: Path,
    test_files: tuple[Path, Path],
    evaluated: tuple[EvalFiles, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ckpt, (src, ref) = str(run_dir / "checkpoint"), test_files
    files, table = evaluated
    figures = files.read_figures()
    assert figures is not None and list(figures["sets"]) == ["test", "validation"]
    assert figures["sets"]["validation"]["test_sentences"] == 20 and figures["probe_pairs"] == 20
    assert "== test (150 sentences)" in table and "== validation (20 sentences)" in table
    for name in ("test", "validation"):
        assert figures["sets"][name]["bleu"] == pytest.approx(
            _sacrebleu(files.references(name), files.hypotheses(name)), abs=1e-5
        )
    assert 10 < figures["sets"]["test"]["bleu"] < 100  # a model that has learned something
    # any pair of files: scored against the very reference file given
    out = tmp_path / "files"
    argv = ["--checkpoint", ckpt, "--src", str(src), "--ref", str(ref), "--out", str(out), "--json"]
    assert eval_main(argv) == 0
    figures = json.loads(capsys.readouterr().out)
    assert list(figures["sets"]) == ["test.src"]
    assert figures["bleu"] == pytest.approx(_sacrebleu(ref, EvalFiles(out).hypotheses("test.src")), abs=1e-5)
    # --limit: the first N pairs of each set, under a name that says so, scored as those files
    some = EvalFiles(tmp_path / "limited")
    argv = ["--checkpoint", ckpt, "--split", "test,validation", "--limit", "40", "--json"]
    assert eval_main([*argv, "--out", str(some.directory)]) == 0
    limited = json.loads(capsys.readouterr().out)["sets"]
    assert list(limited) == ["test[:40]", "validation"]  # validation has 20: whole, name unchanged
    assert limited["test[:40]"]["test_sentences"] == 40 and limited["validation"]["test_sentences"] == 20
    assert read_lines(some.references("test[:40]")) == read_lines(files.references("test"))[:40]
    assert limited["test[:40]"]["bleu"] == pytest.approx(
        _sacrebleu(some.references("test[:40]"), some.hypotheses("test[:40]")), abs=1e-5
    )
    # --concat: every set also as segments of 2 consecutive pairs, scored as those joined files
    argv = ["--checkpoint", ckpt, "--split", "validation", "--concat", "2", "--json", "--beam", "1"]
    assert eval_main([*argv, "--out", str(tmp_path / "concat")]) == 0
    joined = json.loads(capsys.readouterr().out)["sets"]
    assert list(joined) == ["validation", "validation+x2"] and joined["validation+x2"]["test_sentences"] == 10
    refs = read_lines(EvalFiles(tmp_path / "concat").references("validation"))
    assert read_lines(EvalFiles(tmp_path / "concat").references("validation+x2"))[1] == f"{refs[2]} {refs[3]}"
    assert eval_main(["--checkpoint", ckpt, "--concat", "1"]) == 2
    assert "concatenate at least 2" in capsys.readouterr().err
    assert eval_main(["--checkpoint", ckpt, "--limit", "0"]) == 2
    assert "--limit must be at least 1" in capsys.readouterr().err
    # a missing split is one message
    assert eval_main(["--checkpoint", ckpt, "--split", "test_2017"]) == 2
    err = capsys.readouterr().err
    assert "no split 'test_2017'" in err and "Traceback" not in err


@pytest.mark.integration
def test_paired_bootstrap_tells_positions_from_none_and_a_model_from_itself(
    run_dir: Path, test_files: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Greedy (``--beam 1``) to keep it short: without positions the model may run to its length limit."""
    ckpt, files = run_dir / "checkpoint", ["--src", str(test_files[0]), "--ref", str(test_files[1])]
    model, cfg, tok = load_export(ckpt)
    cfg.model.position.kind = "none"  # the same weights, without their position table
    without = build_model(model_args(cfg.model, tok.get_vocab_size()))
    weights = {k: v for k, v in model.state_dict().items() if ".positions." not in k}
    without.load_state_dict(weights)
    save_export(tmp_path / "nopos", without, cfg, tok, step=300)
    argv = ["--checkpoint", str(ckpt), "--compare", str(tmp_path / "nopos"), "--beam", "1", *files]
    assert eval_main([*argv, "--json"]) == 0
    test = json.loads(capsys.readouterr().out)["sets"]["test.src"]["paired"]
    assert test["sentences"] == 150
    assert test["bleu"]["delta"] > 0 and test["bleu"]["p_value"] < 0.05
    assert test["chrf"]["delta"] > 0 and test["chrf"]["p_value"] < 0.05
    assert test["bleu"]["system_mean"] - test["bleu"]["system_ci95"] > test["bleu"]["baseline"]
    itself = ["--checkpoint", str(ckpt), "--compare", str(ckpt), "--beam", "1"]
    assert eval_main([*itself, "--json"]) == 0
    test = json.loads(capsys.readouterr().out)["sets"]["test"]["paired"]  # the config's test split
    for key in ("bleu", "chrf"):
        assert test[key]["delta"] == 0 and test[key]["p_value"] > 0.05
    assert eval_main([*itself, "--samples", "200"]) == 0
    table = capsys.readouterr().out
    assert "paired bootstrap resampling, 200 resamples" in table and "bs:200|seed:12345" in table


def test_paired_bootstrap_is_sacrebleus_except_for_equal_scores() -> None:
    refs = [f"the cat number {i} sat on the mat today ." for i in range(40)]
    worse = [f"a cat number {i} sat on a mat ." for i in range(40)]
    better = [r if i % 3 else f"the cat {i} sat on the mat ." for i, r in enumerate(refs)]

    def sacrebleu_p(system: list[str], baseline: list[str]) -> float:
        test = PairedTest([("b", baseline), ("s", system)], {"BLEU": BLEU(force=True)}, [refs], "bs", 1000)
        _, scores = test()
        result = scores["BLEU"][1]
        assert not isinstance(result, str) and result.p_value is not None
        return result.p_value

    ours = paired_bootstrap(better, worse, refs).metrics["bleu"]
    assert ours.delta > 0 and ours.p_value < 0.05
    assert ours.p_value == pytest.approx(sacrebleu_p(better, worse))
    # BLEU 0 on both sides in every resample (no 4-gram matches): sacreBLEU calls the tie significant
    zero_a, zero_b = ["mat the"] * 40, ["cat a"] * 40
    assert sacrebleu_p(zero_a, zero_b) == pytest.approx(1 / 1001)
    tie = paired_bootstrap(zero_a, zero_b, refs).metrics["bleu"]
    assert tie.delta == 0 and tie.p_value == 1.0


def test_concatenated_sets_join_consecutive_pairs_in_order_without_overlap() -> None:
    test = TestSet("t", [(f"s{i}", f"r{i}") for i in range(7)], probe=[("a", "b")], pretokenized=True)
    three = concatenated(test, 3)
    assert three.name == "t+x3" and three.pretokenized and three.probe == []
    assert three.pairs == [("s0 s1 s2", "r0 r1 r2"), ("s3 s4 s5", "r3 r4 r5")]  # s6 alone: left out
    assert concatenated(test, 7).pairs == [
        (" ".join(f"s{i}" for i in range(7)), " ".join(f"r{i}" for i in range(7)))
    ]
    assert concatenated(test, 8).pairs == []
    with pytest.raises(ValueError, match="at least 2"):
        concatenated(test, 1)
