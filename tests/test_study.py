"""The study: the papers' tokenized BLEU against hand-computed values, settings and their errors, the
report from hand-written figures, a Slurm submission (dry run), and a tiny real study end to end."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_checkpoints import weights

from tpe_train.evaluation.decoding import read_lines
from tpe_train.evaluation.evaluate import EvalFiles
from tpe_train.evaluation.metrics import (
    compound_split,
    lc_tokenized_bleu,
    moses_tokenize,
    paired_bootstrap,
    tokenized_bleu,
)
from tpe_train.study.cli import main
from tpe_train.study.grid import Setting, Study, StudyError, parse_seeds, parse_setting
from tpe_train.study.plots import _cosine
from tpe_train.study.report import write_report
from tpe_train.study.runner import _Processes

PNG = b"\x89PNG\r\n\x1a\n"
PLOTS = ("bleu_per_encoding", "bleu_by_length", "probe_accuracy", "position_similarity")

# ---------------------------------------------------------------------------------------------------
# Tokenized BLEU with compound splitting (get_ende_bleu.sh / compound_split_bleu.sh)


@pytest.mark.parametrize(
    ("text", "lang", "tokens"),
    [
        ("Das ist ein rich-text Format, oder?", "de", "Das ist ein rich-text Format , oder ?"),
        (
            'Toms "Haus" & <b> [x] |y',
            "de",
            "Toms &quot; Haus &quot; &amp; &lt; b &gt; &#91; x &#93; &#124; y",
        ),
        ("Er sagte... nein.", "de", "Er sagte ... nein ."),
        ("5,300 Euro, 1,5 Mio. Menschen.", "de", "5,300 Euro , 1,5 Mio. Menschen ."),  # Mio. is listed
        ("Dr. Müller kam z.B. gestern an.", "de", "Dr. Müller kam z.B. gestern an ."),
        ("Es ist gut. Wir gehen.", "de", "Es ist gut . Wir gehen ."),
        ("Nr. 5 und Nr. Drei.", "de", "Nr. 5 und Nr . Drei ."),  # Nr. stays before numbers only
        ("Sie sagte 'ja'.", "de", "Sie sagte &apos; ja &apos; ."),  # de: every apostrophe a token
        ("I don't know the 1990's.", "en", "I don &apos;t know the 1990 &apos;s ."),  # en: split right
        ("l'homme d'affaires", "fr", "l&apos; homme d&apos; affaires"),  # fr: split left
        ("  (Hallo)\tWelt  ", "de", "( Hallo ) Welt"),
    ],
)
def test_moses_tokenizer_by_hand(text: str, lang: str, tokens: str) -> None:
    assert moses_tokenize(text, lang) == tokens


def test_compound_split_by_hand() -> None:
    assert compound_split("rich-text format") == "rich ##AT##-##AT## text format"
    assert compound_split("E-Mail-Programm") == "E ##AT##-##AT## Mail ##AT##-##AT## Programm"
    # like Perl's s{(\S)-(\S)}{...}g matches do not overlap: a one-letter middle keeps its hyphen
    assert compound_split("a-b-c") == "a ##AT##-##AT## b-c"
    assert compound_split("Berlin - Paris , -5") == "Berlin - Paris , -5"  # only hyphens inside words


def test_tokenized_bleu_by_hand() -> None:
    ref = ["Das neue E-Mail-Programm ist sehr gut."]
    hyp = ["Das neue E-Mail-Programm ist gut."]
    # split: ref 11 tokens, hyp 10: Das neue E ##AT##-##AT## Mail ##AT##-##AT## Programm ist gut .
    # matches 10/10, 8/9, 6/8, 5/7; brevity penalty exp(1 - 11/10)
    expected = 100 * math.exp(1 - 11 / 10) * (1 * 8 / 9 * 6 / 8 * 5 / 7) ** 0.25
    score, method = tokenized_bleu(hyp, ref, "de")
    assert score == pytest.approx(expected, rel=1e-9)
    assert method == "moses-tok:de+compound-split|multi-bleu"
    # unsplit: ref 7 tokens, hyp 6; matches 6/6, 4/5, 2/4, 1/3; brevity penalty exp(1 - 7/6)
    expected = 100 * math.exp(1 - 7 / 6) * (1 * 4 / 5 * 2 / 4 * 1 / 3) ** 0.25
    assert tokenized_bleu(hyp, ref, "de", split_compounds=False)[0] == pytest.approx(expected, rel=1e-9)
    # multi-bleu: no smoothing, so a missing 4-gram match gives 0; the same text gives 100
    assert tokenized_bleu(["ein Hund ."], ["ein Hund lief ."], "de")[0] == 0.0
    assert tokenized_bleu(ref, ref, "de")[0] == pytest.approx(100.0)


def test_lowercased_tokenized_bleu_by_hand() -> None:
    """The Multi30k literature's BLEU: Moses-tokenized, no compound splitting, lowercased (multi-bleu -lc)."""
    ref = ["Ein Mann fährt ein E-Bike."]
    hyp = ["ein mann fährt ein e-bike ."]
    score, method = lc_tokenized_bleu(hyp, ref, "de")
    assert method == "moses-tok:de|multi-bleu -lc" and score == pytest.approx(100.0)
    assert tokenized_bleu(hyp, ref, "de", split_compounds=False)[0] < 50  # cased: Ein/ein, Mann/mann differ
    # hyp: ein mann fährt ein . (5 tokens), ref 6: matches 5/5, 3/4, 2/3, 1/2; brevity exp(1 - 6/5)
    expected = 100 * math.exp(1 - 6 / 5) * (1 * 3 / 4 * 2 / 3 * 1 / 2) ** 0.25
    assert lc_tokenized_bleu(["Ein Mann fährt ein."], ref, "de")[0] == pytest.approx(expected, rel=1e-9)
    # upper case throughout: only "!" against "." differs; 5/6, 4/5, 3/4, 2/3
    expected = 100 * (5 / 6 * 4 / 5 * 3 / 4 * 2 / 3) ** 0.25
    shouted = ["EIN MANN FÄHRT EIN E-BIKE !"]
    assert lc_tokenized_bleu(shouted, ref, "de")[0] == pytest.approx(expected, rel=1e-9)


# ---------------------------------------------------------------------------------------------------
# Settings, seeds and the errors of tpe-study


def test_settings_name_the_encoding_and_where_positions_are_removed() -> None:
    assert parse_setting("rope") == Setting("rope")
    noenc = parse_setting("sinusoidal-noenc")
    assert noenc.overrides() == [
        "model.position.kind=sinusoidal",
        "model.position.encoder=false",
        "model.position.decoder=true",
    ]
    study = Study(Path("s"), "demo", settings=["learned-nodec"], seeds=[4])
    cfg = study.config(parse_setting("learned-nodec"), 4)
    args = cfg.model.args(vocab_size=100, pad_id=0, bos_id=1, eos_id=2)
    assert (args.encoder_position, args.decoder_position) == ("learned", "none")
    assert cfg.train.seed == 4
    assert study.run_dir(noenc, 2) == Path("s/runs/s2-noenc/sinusoidal")
    assert parse_seeds("1-3,7") == [1, 2, 3, 7]


def test_a_setting_may_name_a_position_augmentation() -> None:
    shape = parse_setting("sinusoidal+shape")
    assert shape == Setting("sinusoidal", "", "shape") and shape.name == "sinusoidal+shape"
    assert shape.overrides()[-1] == "model.position.augment=shape"
    nodec = parse_setting("rope+randomized-nodec")
    assert (nodec.kind, nodec.variant, nodec.augment, nodec.name) == (
        "rope", "nodec", "randomized", "rope+randomized-nodec"
    )  # fmt: skip
    study = Study(Path("s"), "demo", ["model.position.randomized_range=256"],
                  settings=["learned+randomized", "learned"], seeds=[1])  # fmt: skip
    cfg = study.config(parse_setting("learned+randomized"), 1)
    assert (cfg.model.position.augment, cfg.model.position.randomized_range) == ("randomized", 256)
    assert study.config(parse_setting("learned"), 1).model.position.augment == "none"
    assert study.run_dir(parse_setting("learned+randomized"), 1) == Path("s/runs/s1-randomized/learned")
    assert study.run_dir(nodec, 3) == Path("s/runs/s3-nodec-randomized/rope")
    assert "trained with shape positions" in shape.describe()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--encodings", "rotary"], "'rotary' is not a position encoding"),
        (["--encodings", "t5+shape"], "'shape' is not a position augmentation of t5"),
        (["--encodings", "learned+cape"], "valid: learned+shape, learned+randomized"),
        (["--encodings", "rope+"], "'' is not a position augmentation of rope"),
        (["--encodings", "rope+shape", "model.position.augment=cape"], "drop it from the overrides"),
        (["--encodings", "none-noenc"], "'none' has no positions to remove"),
        (["train.seed=3"], "the study sets train.seed itself"),
        (["--seeds", "1,x"], "is not a list of seeds"),
        (["model.n_heds=4"], "unknown key 'model.n_heds'"),
        (["--jobs", "0"], "--jobs must be at least 1"),
        (["--jobs", "2", "--launch", "configs/accelerate/cpu_ddp.yaml"], "drop --jobs or --launch"),
    ],
)
def test_bad_input_is_one_message_and_exit_2(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--preset", "demo", "--out", str(tmp_path / "s"), "--dry-run", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "s").exists()  # nothing written


def test_slurm_submission_is_one_array_per_seed_and_variant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "study"
    argv = ["run", "--preset", "demo", "--encodings", "sinusoidal,rope,sinusoidal-noenc", "--seeds", "1,2",
            "--out", str(out), "--slurm", "--slurm-args", "--gpus-per-node 8 --time 4:00:00",
            "--average", "5", "--dry-run", "train.max_steps=100"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    # tpe-launch's position sweep: index 1 sinusoidal, 6 rope; the seed's directory is the sweep root
    assert text.count("#SBATCH --array=1,6") == 2 and text.count("#SBATCH --array=1\n") == 2
    assert f"--sweep-root {out.resolve()}/runs/s2 " in text
    assert f"--sweep-root {out.resolve()}/runs/s1-noenc " in text
    assert "model.position.encoder=false" in text and "train.seed=2" in text
    # averaging: one eval job per run after its own array element
    assert text.count("tpe-ckpt average") == 6
    assert '#SBATCH --dependency="afterok:<array job>_6"' in text  # quoted for sbatch: a space
    averaged = out.resolve() / "runs/s1/rope/averaged-last5"  # its figures and test hypotheses
    assert f"tpe-eval --checkpoint {averaged} --json --out {averaged}" in text
    assert not out.exists()  # a dry run writes nothing


def test_portable_names_this_python_by_any_of_its_names(tmp_path: Path) -> None:
    from tpe_train.study.archive import portable

    bindir = Path(sys.executable).parent
    text = f"$ {bindir}/python3.11 -m x; {bindir}/python -m y; {bindir}/python3 z; {bindir}/pythonista"
    assert (
        portable(text, tmp_path)
        == f"$ python -m x; python -m y; python z; {portable(str(bindir), tmp_path)}/pythonista"
    )


def test_a_second_seed_of_some_settings_adds_only_those_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Running a study again with other --encodings/--seeds adds exactly their runs: seed 2 of two
    settings is two runs, not seed 2 of every setting; naming the rest later makes the grid whole."""
    root = tmp_path / "study"
    Study(root, "demo", settings=["sinusoidal", "none", "rope"], seeds=[1]).save()
    for name in ("sinusoidal", "none", "rope"):  # seed 1 is done
        path = Study.load(root).eval_path(parse_setting(name), 1)
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(_figures(10.0, {"1-10": 10.0})))
    argv = ["run", "--preset", "demo", "--encodings", "rope,sinusoidal", "--seeds", "2", "--out", str(root)]
    assert main([*argv, "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum("done already" in line for line in lines) == 3
    commands = [line for line in lines if "-m tpe_train.train" in line]
    assert len(commands) == 2 and all("train.seed=2" in line for line in commands)
    assert sorted(re.findall(r"model\.position\.kind=(\w+)", " ".join(commands))) == ["rope", "sinusoidal"]
    study = Study.load(root).merge(Study(root, "demo", settings=["rope", "sinusoidal"], seeds=[2]))
    study.save()
    again = Study.load(root)
    assert [(s.name, seed) for s, seed in again.grid()] == [
        ("sinusoidal", 1), ("none", 1), ("rope", 1), ("sinusoidal", 2), ("rope", 2)]  # fmt: skip
    assert again.describe_grid() == "3 settings, 5 runs (seed 1: all; seed 2: sinusoidal, rope)"
    report = write_report(again).read_text()
    assert "3 settings, 5 runs (seed 1: all; seed 2: sinusoidal, rope); 3 of 5 runs have figures" in report
    assert "| `rope` | 2 | missing |" in report and "| `none` | 2 |" not in report  # the list of runs
    # the missing run named later: the whole grid again, stored as settings x seeds
    whole = again.merge(Study(root, "demo", settings=["none"], seeds=[2]))
    assert whole.cells is None and len(whole.grid()) == 6
    assert whole.describe_grid() == "3 settings x 2 seeds (1, 2)"
    # a manifest whose runs name a setting it does not have is refused, with what to do
    data = json.loads((root / "study.json").read_text())
    data["cells"].append(["alibi", 1])
    (root / "study.json").write_text(json.dumps(data))
    with pytest.raises(StudyError, match="is not \\[setting, seed\\]"):
        Study.load(root)


# ---------------------------------------------------------------------------------------------------
# The report from hand-written figures (no training)


def _figures(bleu: float, buckets: dict[str, float | None], probe: float | None = 0.5) -> dict[str, object]:
    by_length: dict[str, dict[str, object]] = {}
    for name, value in buckets.items():
        by_length[name] = {"sentences": 10, "bleu": value}
        if value is None:
            by_length[name]["note"] = "longer than the encoder's position encoding can represent"
    return {
        "bleu": bleu,
        "chrf": 2 * bleu,
        "exact_match": 0.25,
        "probe_accuracy": probe,
        "probe_pairs": 4,
        "test_sentences": 20,
        "bleu_by_length": by_length,
        "bleu_signature": "nrefs:1|tok:13a",
    }


def test_report_means_deviations_and_unrepresentable_lengths(tmp_path: Path) -> None:
    study = Study(tmp_path / "study", "demo", settings=["rope", "learned"], seeds=[1, 2, 3])
    study.save()
    values = {("rope", 1): 10.0, ("rope", 2): 20.0, ("learned", 1): 30.0, ("learned", 2): 33.0}
    for (name, seed), bleu in values.items():
        long = None if name == "learned" else bleu / 2  # the learned table cannot represent 21+
        path = study.eval_path(parse_setting(name), seed)
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(_figures(bleu, {"1-10": bleu, "11-20": bleu, "21+": long})))
    # rope seed 1 was stopped and resumed: its wall time is that of its two processes (60 + 30 min);
    # learned seed 1 ran 2 h 5 min, learned seed 2 is still running (a start without an exit)
    stamp = "{} 2026-12-01 10:00:00 (unix {})\n"
    logs = {
        ("rope", 1): [("# started", 0), ("# exit 75 at", 3600), ("# started", 4000), ("# exit 0 at", 5800)],
        ("learned", 1): [("# started", 6000), ("# exit 0 at", 13500)],
        ("learned", 2): [("# started", 14000)],
    }
    for (name, seed), lines in logs.items():
        log = study.run_dir(parse_setting(name), seed) / "study.log"
        log.write_text(
            "".join(stamp.format(what, 1.8e9 + t) + "$ python -m tpe_train.train\n" for what, t in lines)
        )
    report = write_report(study).read_text()
    assert (
        "| `rope` | 1 | 10.00 | 1 h 30 min |" in report and "| `learned` | 1 | 30.00 | 2 h 05 min |" in report
    )
    assert "| `learned` | 2 | 33.00 | n/a |" in report
    assert "3 h 35 min for 2 runs together; 3 h 45 min from the first start to the last end" in report
    rows: dict[str, str] = {}
    for line in report.splitlines():  # the first row of a setting is the table's; later ones list runs
        if line.startswith("| `"):
            rows.setdefault(line.split(" | ")[0][3:-1], line)
    # mean ± sample standard deviation over the two seeds present
    assert rows["rope"].startswith("| `rope` | 2 | 15.0 ± 7.1 | 30.0 ± 14.1 | 25.0% ± 0.0 | 50.0% ± 0.0 |")
    assert rows["rope"].endswith("| 7.5 ± 3.5 |")
    assert rows["learned"].endswith("| too long |") and "31.5 ± 2.1" in rows["learned"]
    assert "2 runs have no figures yet" in report and "4 of 6 runs have figures" in report
    summary = json.loads((study.report_dir / "summary.json").read_text())
    rope = summary["settings"]["rope"]
    assert rope["bleu"]["mean"] == pytest.approx(15.0)
    assert rope["bleu"]["sd"] == pytest.approx(statistics.stdev([10.0, 20.0]))
    assert summary["settings"]["learned"]["too_long"] == {"21+": 10}
    for stem in ("bleu_per_encoding", "bleu_by_length", "probe_accuracy"):
        assert (study.report_dir / f"{stem}.png").read_bytes().startswith(PNG)
    # no exported checkpoints here: the heat map is left out, and the report says so
    assert "no exported `learned` checkpoint yet" in report
    # nor kept hypotheses: no paired tests against the baseline (rope: the first setting, no sinusoidal)
    assert "## Paired significance against `rope`" in report and "no paired tests" in report
    assert summary["baseline"] == "rope" and summary["settings"]["learned"]["paired"]["per_seed"] == {}


def test_study_modules_call_libraries_and_share_types_below_report_and_plots() -> None:
    """The runner imports no command line's ``main``; plots and results never import report."""
    import ast

    import tpe_train.study as study_pkg

    folder = Path(study_pkg.__file__).parent
    for name in ("runner.py", "results.py", "plots.py", "report.py", "grid.py"):
        tree = ast.parse((folder / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert "main" not in [a.name for a in node.names], f"{name} imports {node.module}.main"
                if name in ("results.py", "plots.py"):
                    assert node.module != "tpe_train.study.report", f"{name} imports report"


def test_position_similarity_is_cosine_between_rows() -> None:
    table = torch.tensor([[1.0, 0.0], [0.0, 2.0], [-3.0, 0.0]])
    assert _cosine(table).tolist() == [[1.0, 0.0, -1.0], [0.0, 1.0, 0.0], [-1.0, 0.0, 1.0]]


# ---------------------------------------------------------------------------------------------------
# A tiny real study: 2 encodings x 2 seeds, trained, evaluated, reported

TINY = [
    "data.synthetic.train_size=300",
    "data.synthetic.valid_size=10",
    "data.synthetic.test_size=20",
    "data.synthetic.long_size=6",
    "data.synthetic.probe_size=6",
    "data.synthetic.max_words=12",
    "data.synthetic.long_max_words=16",
    "data.vocab_size=200",
    "data.max_tokens=1024",
    "model.d_model=32",
    "model.ffn_dim=64",
    "model.encoder_layers=1",
    "model.decoder_layers=1",
    "train.max_steps=2",
    "train.save_every=1",  # two checkpoints to average (--average 2), as the papers average theirs
    "train.keep_last=2",
    "train.valid_bleu_size=0",
    "eval.beam=1",
    "eval.length_buckets=[6,12]",
]


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("study") / "tiny"
    cmd = [sys.executable, "-m", "tpe_train.study.cli", "run", "--preset", "demo", "--seeds", "1,2",
           "--encodings", "sinusoidal,learned", "--out", str(out), "--heatmap-positions", "40",
           "--average", "2", "--jobs", "2", *TINY]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[4/4] learned seed 2: BLEU" in proc.stdout
    return out


@pytest.mark.integration
def test_study_trains_every_cell_and_averages_its_last_checkpoints(study_dir: Path) -> None:
    for seed in (1, 2):
        for kind in ("sinusoidal", "learned"):
            run = study_dir / "runs" / f"s{seed}" / kind
            assert (run / "eval.json").is_file() and (run / "checkpoint" / "model.safetensors").is_file()
            assert f"model.position.kind={kind}" in (run / "study.log").read_text()
            # the averaged model is the mean of the last two checkpoints' weights, and is evaluated
            last = [weights(run / f"checkpoints/step-{s:08d}") for s in (1, 2)]  # from the shards
            averaged = load_file(str(run / "averaged-last2" / "model.safetensors"))
            name = "encoder.layers.0.ffn.fc_in.weight"
            assert not torch.equal(last[0][name], last[1][name])
            torch.testing.assert_close(averaged[name], (last[0][name] + last[1][name]) / 2)
            figures = json.loads((run / "averaged-last2" / "eval.json").read_text())
            assert figures["test_sentences"] == 20 and figures["probe_pairs"] == 6


@pytest.mark.integration
def test_parallel_runs_overlap_and_share_the_cores(study_dir: Path) -> None:
    """--jobs 2: the first two runs train at the same time, each with half of the cores. Their
    processes' lifetimes, as the study logged them (start before the process, exit after it), overlap;
    the files the runs write are no proof: on a loaded machine a tiny run may finish its training before
    the other has imported torch."""
    first, second = (study_dir / "runs" / "s1" / kind for kind in ("sinusoidal", "learned"))
    spans = []
    for run in (first, second):
        text = (run / "study.log").read_text()
        started = re.findall(r"^# started .* \(unix ([0-9.]+)\)$", text, re.M)
        ended = re.findall(r"^# exit 0 at .* \(unix ([0-9.]+)\)$", text, re.M)
        assert len(started) == len(ended) == 1, text[-2000:]
        spans.append((float(started[0]), float(ended[0])))
    assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1], spans
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert f"train.threads={threads}" in (first / "study.log").read_text()


@pytest.mark.integration
def test_interrupting_parallel_runs_stops_them_and_starts_no_more(tmp_path: Path) -> None:
    """Ctrl-C during --jobs 2: both running runs get SIGTERM (they save and exit), the third never
    starts, and the study exits at once with 130 instead of training what was queued."""
    out = tmp_path / "s"
    long = [o for o in TINY if not o.startswith(("train.max_steps", "train.save_every"))]
    cmd = [sys.executable, "-m", "tpe_train.study.cli", "run", "--preset", "demo", "--seeds", "1",
           "--jobs", "2", "--encodings", "sinusoidal,learned,rope", "--out", str(out), *long,
           "train.max_steps=100000", "train.save_every=100000"]  # fmt: skip
    # A harness started in the background may ignore SIGINT, and Python then installs no Ctrl-C handler
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    runs = [out / "runs" / "s1" / kind for kind in ("sinusoidal", "learned")]
    deadline = time.monotonic() + 300
    while not all((run / "config.yaml").is_file() for run in runs):  # both are training
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 130, output[-3000:]
    for run in runs:  # each saved where SIGTERM found it
        assert (run / "preempted.json").is_file(), output[-3000:]
    assert not (out / "runs" / "s1" / "rope").exists()


@pytest.mark.integration
def test_a_signal_to_the_study_starts_no_more_runs_even_when_the_run_did_not_save(tmp_path: Path) -> None:
    """SIGTERM to the study while its first run's trainer is still starting (before it handles signals,
    so the signal ends it without a checkpoint), and again: the study exits 75 and the second run never
    starts. Whichever way the trainer ends (killed while importing, or saved and exited 75), the study
    stops: the outcome does not depend on the timing."""
    out = tmp_path / "s"
    long = [o for o in TINY if not o.startswith(("train.max_steps", "train.save_every"))]
    cmd = [sys.executable, "-m", "tpe_train.study.cli", "run", "--preset", "demo", "--seeds", "1",
           "--jobs", "1", "--encodings", "sinusoidal,learned", "--out", str(out), *long,
           "train.max_steps=100000", "train.save_every=100000"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = out / "runs" / "s1" / "sinusoidal" / "study.log"
    deadline = time.monotonic() + 300
    while not (log.is_file() and "# started" in log.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)  # a second signal changes nothing
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 75, output[-3000:]
    assert "stopped by a signal" in output and "sinusoidal seed 1" in output, output[-3000:]
    assert not (out / "runs" / "s1" / "learned").exists(), output[-3000:]


@pytest.mark.integration
def test_study_writes_the_table_of_means_and_deviations(study_dir: Path) -> None:
    report = (study_dir / "report" / "report.md").read_text()
    assert (
        "| setting | seeds | BLEU | chrF | exact match | word-order probe | BLEU vs `sinusoidal` | chrF "
        "| 1-6 | 7-12 | 13+ † |" in report
    )
    assert "4 of 4 runs have figures" in report and "at most 12 words" in report
    assert "averaged over the last 2 checkpoints" in report
    evals = {k: [json.loads((study_dir / f"runs/s{s}/{k}/averaged-last2/eval.json").read_text())
                 for s in (1, 2)] for k in ("sinusoidal", "learned")}  # fmt: skip
    summary = json.loads((study_dir / "report" / "summary.json").read_text())["settings"]
    for kind, figures in evals.items():
        bleus = [f["bleu"] for f in figures]
        assert summary[kind]["bleu"]["mean"] == pytest.approx(statistics.fmean(bleus))
        assert summary[kind]["bleu"]["sd"] == pytest.approx(statistics.stdev(bleus))
        row = next(line for line in report.splitlines() if line.startswith(f"| `{kind}` | 2 |"))
        assert f"{statistics.fmean(bleus):.1f} ± {statistics.stdev(bleus):.1f}" in row


@pytest.mark.integration
def test_report_pairs_every_setting_with_the_baseline_per_seed_and_pooled(study_dir: Path) -> None:
    """The paired bootstrap of learned against sinusoidal (the default baseline) uses the test hypotheses
    each averaged model's evaluation kept: seed with seed, and all seeds' sentences pooled."""
    summary = json.loads((study_dir / "report" / "summary.json").read_text())
    assert summary["baseline"] == "sinusoidal" and summary["settings"]["sinusoidal"]["paired"] is None
    paired = summary["settings"]["learned"]["paired"]
    kept = {}
    for kind in ("sinusoidal", "learned"):
        for seed in (1, 2):
            files = EvalFiles(study_dir / f"runs/s{seed}/{kind}/averaged-last2")
            assert files.read_figures() is not None
            hyps, refs = files.read_set("test") or ([], [])
            assert len(hyps) == len(refs) == 20 and refs == read_lines(files.references("test"))
            kept[kind, seed] = hyps, refs
    pooled: list[list[str]] = [[], [], []]
    for seed in (1, 2):
        (mine, refs), (theirs, _) = kept["learned", seed], kept["sinusoidal", seed]
        expected = paired_bootstrap(mine, theirs, refs)
        for key in ("bleu", "chrf"):
            assert paired["per_seed"][str(seed)][key] == pytest.approx(expected.metrics[key].as_dict())
        for part, lines in zip(pooled, (mine, theirs, refs), strict=True):
            part += lines
    expected = paired_bootstrap(*pooled)
    assert paired["pooled"]["sentences"] == 40
    for key in ("bleu", "chrf"):
        assert paired["pooled"][key] == pytest.approx(expected.metrics[key].as_dict())
    report = (study_dir / "report" / "report.md").read_text()
    assert "## Paired significance against `sinusoidal`" in report
    assert "| `learned` | pooled (1, 2) |" in report
    row = next(line for line in report.splitlines() if line.startswith("| `learned` | 2 |"))
    delta, p = expected.metrics["bleu"].delta, expected.metrics["bleu"].p_value
    assert f"| {delta:+.1f} (p {'< 0.001' if p < 0.001 else f'{p:.3f}'}) |" in row


@pytest.mark.integration
def test_study_plots_are_png_files_and_tensorboard_images(study_dir: Path) -> None:
    report = study_dir / "report"
    for stem in PLOTS:
        data = (report / f"{stem}.png").read_bytes()
        assert data.startswith(PNG) and len(data) > 1000, stem
        assert f"![{stem.replace('_', ' ')}]({stem}.png)" in (report / "report.md").read_text()
    events = EventAccumulator(str(report / "tb"), size_guidance={"images": 0})
    events.Reload()
    assert sorted(events.Tags()["images"]) == sorted(f"study/{stem}" for stem in PLOTS)
    for stem in PLOTS:
        (image,) = events.Images(f"study/{stem}")
        assert image.encoded_image_string.startswith(PNG) and image.width > 100 and image.height > 100


@pytest.mark.integration
def test_report_regathers_an_existing_study_without_training(
    study_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = study_dir / "report"
    before = (report / "report.md").read_text()
    for path in report.glob("*.png"):
        path.unlink()
    (report / "report.md").unlink()
    assert main(["report", str(study_dir), "--heatmap-positions", "40"]) == 0
    assert (report / "report.md").read_text() == before
    assert all((report / f"{stem}.png").read_bytes().startswith(PNG) for stem in PLOTS)
    assert len(list((report / "tb").glob("events.out.tfevents.*"))) == 1  # replaced, not added to
    # running the same study again trains nothing: every run has its figures
    assert main(["run", "--preset", "demo", "--encodings", "sinusoidal,learned", "--seeds", "1,2",
                 "--out", str(study_dir), "--no-report", "--average", "2", *TINY]) == 0  # fmt: skip
    assert capsys.readouterr().out.count("done already") == 4
    # a dry run of the study extended by a seed names the finished runs as such, and the new ones' commands
    assert main(["run", "--preset", "demo", "--encodings", "sinusoidal,learned", "--seeds", "1-3",
                 "--out", str(study_dir), "--average", "2", "--dry-run", *TINY]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert sum("done already" in line for line in lines) == 4
    assert sum("-m tpe_train.train" in line for line in lines) == 2
    assert all("train.seed=3" in line for line in lines if "-m tpe_train.train" in line)
    assert main(["report", str(study_dir / "runs")]) == 2
    assert "is not a study directory" in capsys.readouterr().err


def test_a_runs_log_shows_each_line_while_it_runs(tmp_path: Path) -> None:
    """study.log is what a user tails during an hour-long run: a printed line is in it before the run
    ends. The child prints, then waits for the test to have seen the line (no timing involved); the
    line is built at run time, so the command echoed at the top of the log does not contain it."""
    log, seen = tmp_path / "study.log", tmp_path / "seen"
    child = (
        "import os, time\nprint('step %d/5000' % 100, flush=True)\n"
        f"while not os.path.exists({str(seen)!r}): time.sleep(0.05)"
    )
    cmd = [sys.executable, "-c", child]
    result: list[int] = []
    thread = threading.Thread(
        target=lambda: result.append(_Processes().run_logged(cmd, dict(os.environ), log, echo=False))
    )
    thread.start()
    deadline = time.monotonic() + 60
    try:
        while "step 100/5000" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, f"the line never reached the log: {log.read_text()!r}"
            time.sleep(0.05)
    finally:
        seen.touch()
        thread.join(60)
    assert result == [0] and log.read_text().rstrip().splitlines()[-1].startswith("# exit 0 at ")


@pytest.mark.integration
def test_an_archive_holds_the_figures_without_weights_or_machine_paths(
    study_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tpe-study archive``: what the report needs, portable; the report from the archive is the study's
    own (heat maps included), and a study run on the archive trains nothing."""
    monkeypatch.chdir(tmp_path)  # the archive names paths relative to the working directory
    dest = tmp_path / "docs" / "study"
    assert main(["archive", str(study_dir), str(dest), "--no-report"]) == 0
    files = sorted(p.relative_to(dest) for p in dest.rglob("*") if p.is_file())
    assert [p for p in files if p.suffix == ".safetensors"] == [
        Path(f"runs/s{seed}/learned/positions.safetensors") for seed in (1, 2)
    ]
    assert not any("checkpoint" in p.parts[-2] or p.name == "run.lock" for p in files if len(p.parts) > 1)
    for path in (dest / p for p in files if p.suffix in (".json", ".yaml", ".log")):
        text = path.read_text()
        assert str(tmp_path) not in text and sys.executable not in text, path
    config = (dest / "runs/s1/learned/config.yaml").read_text()
    assert f"run_dir: {os.path.relpath(study_dir / 'runs/s1/learned', tmp_path)}\n" in config
    exported = load_file(str(study_dir / "runs/s1/learned/checkpoint/model.safetensors"))
    tables = load_file(str(dest / "runs/s1/learned/positions.safetensors"))
    assert sorted(tables) == ["decoder.positions.0.table.weight", "encoder.positions.0.table.weight"]
    assert all(torch.equal(t, exported[k]) for k, t in tables.items())
    assert not any(p.suffix == ".ref" for p in files)  # the test set stays in the corpus
    # the report of the archive is the study's: the same table, every plot (heat maps from the tables);
    # its paired tests need one run's references of each pair, which an archive alone does not have
    assert main(["report", str(dest), "--heatmap-positions", "40"]) == 0
    ours, theirs = (json.loads((d / "report/summary.json").read_text()) for d in (dest, study_dir))
    figures = [{k: {**v, "paired": None} for k, v in d["settings"].items()} for d in (ours, theirs)]
    assert figures[0] == figures[1]  # figures, means and deviations
    assert ours["settings"]["learned"]["paired"]["seeds_without_hypotheses"] == [1, 2]
    # one run with its references (e.g. trained after a restore): every pair on that test set is
    # tested again, seed 2's included (the same corpus and data settings: the same references)
    ref = study_dir / "runs/s1/sinusoidal/averaged-last2/hypotheses"
    for path in ref.glob("*.ref"):
        (dest / path.relative_to(study_dir)).write_bytes(path.read_bytes())
    assert main(["report", str(dest), "--heatmap-positions", "40"]) == 0
    assert json.loads((dest / "report/summary.json").read_text()) == theirs
    assert all((dest / "report" / f"{stem}.png").read_bytes().startswith(PNG) for stem in PLOTS)
    assert "heat map is missing" not in (dest / "report/report.md").read_text()
    capsys.readouterr()
    assert main(["run", "--preset", "demo", "--encodings", "sinusoidal,learned", "--seeds", "1,2", "--out",
                 str(dest), "--no-report", "--average", "2", *TINY]) == 0  # fmt: skip
    assert capsys.readouterr().out.count("done already") == 4
    # archiving again adds to the archive and replaces its report; another study's runs are refused
    assert main(["archive", str(study_dir), str(dest)]) == 0
    assert len(list((dest / "report" / "tb").glob("events.out.tfevents.*"))) == 1
    other = tmp_path / "other"
    Study(other, "demo", ["train.max_steps=3"], ["sinusoidal"], [1]).save()
    assert main(["archive", str(other), str(dest)]) == 2
    assert "a study directory holds one preset, overrides" in capsys.readouterr().err
    # restoring from an archive without references keeps its report (and so its paired tests)
    archived, restored = tmp_path / "archived", tmp_path / "restored"
    assert main(["archive", str(study_dir), str(archived)]) == 0
    before = (archived / "report/report.md").read_text()
    assert main(["archive", str(archived), str(restored)]) == 0
    assert "keeps its report" in capsys.readouterr().out
    assert (archived / "report/report.md").read_text() == before
    assert (restored / "report/report.md").read_text() == before and "p (BLEU)" in before
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine\n")
    assert main(["archive", str(study_dir), str(tmp_path / "notes")]) == 2
    assert "is not a study archive" in capsys.readouterr().err
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine\n"


def _finished(study: Study, name: str, seed: int, bleu: float, hypotheses: list[str] | None) -> None:
    """A finished run of ``study`` with hand-written figures and, if given, kept test hypotheses."""
    path = study.eval_path(parse_setting(name), seed)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**_figures(bleu, {"1-10": bleu}), "test_set": "test"}))
    if hypotheses is not None:
        files = EvalFiles(path.parent)
        files.hypotheses("test").parent.mkdir()
        files.hypotheses("test").write_text("\n".join(hypotheses) + "\n")
        files.references("test").write_text("\n".join(REFS) + "\n")


REFS = [f"the cat {i} sees a dog near the river bank today" for i in range(40)]


def test_a_report_joins_study_directories_with_their_own_overrides(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An archive without hypotheses (the first seven, say), a new study that trained `sinusoidal` again
    and a newer encoding, and a study with an override of its own: one report, each part's overrides
    listed, the twice-held cell taken from the directory named first, paired tests where both sides
    kept hypotheses (the new study lends its references to the others)."""
    archive = Study(tmp_path / "archive", "demo", settings=["none", "sinusoidal"], seeds=[1])
    new = Study(tmp_path / "new", "demo", settings=["sinusoidal", "kerple_log"], seeds=[1])
    aug = Study(tmp_path / "aug", "demo", ["model.position.randomized_range=256"],
                settings=["learned+randomized"], seeds=[1])  # fmt: skip
    for study in (archive, new, aug):
        study.save()
    _finished(archive, "none", 1, 40.0, None)
    _finished(archive, "sinusoidal", 1, 99.0, None)
    _finished(new, "sinusoidal", 1, 98.0, REFS)
    _finished(new, "kerple_log", 1, 60.0, [r if i % 3 else "a dog" for i, r in enumerate(REFS)])
    aug_hyp = [r.replace("river", "lake") for r in REFS]
    _finished(aug, "learned+randomized", 1, 90.0, aug_hyp)
    EvalFiles(aug.run_dir(parse_setting("learned+randomized"), 1)).references("test").unlink()  # an archive's
    out = tmp_path / "combined"
    argv = [
        "report",
        str(tmp_path / "new"),
        "--include",
        str(tmp_path / "archive"),
        "--include",
        str(aug.root),
    ]
    assert main([*argv, "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert str(tmp_path) not in report  # parts are named by their folder, no machine path
    assert "Combined from 3 study directories: `new` (2 settings x 1 seed (1); overrides: none)" in report
    assert "`aug` (1 setting x 1 seed (1); overrides: `model.position.randomized_range=256`)" in report
    assert "`sinusoidal` seed 1 from `new` (archive's copy: BLEU 99.00)" in report
    rows: dict[str, str] = {}
    for line in report.splitlines():  # the first row of a setting is the table's; later ones list runs
        if line.startswith("| `"):
            rows.setdefault(line.split(" | ")[0], line)
    assert rows["| `sinusoidal`"].startswith("| `sinusoidal` | 1 | 98.0 |")  # the new study's run
    assert rows["| `none`"].startswith("| `none` | 1 | 40.0 |")
    assert "| `learned+randomized` | 1 | 90.0 |" in report
    assert (
        "`archive/runs/s1/none/eval.json`" in report
        and "`aug/runs/s1-randomized/learned/eval.json`" in report
    )
    tests = json.loads((out / "summary.json").read_text())["settings"]
    assert tests["kerple_log"]["paired"]["per_seed"]["1"]["bleu"]["delta"] < 0  # a third of it is wrong
    assert tests["learned+randomized"]["paired"]["per_seed"]["1"]["bleu"]["delta"] < 0  # lent references
    assert tests["none"]["paired"]["seeds_without_hypotheses"] == [1]
    assert [p["study"] for p in json.loads((out / "summary.json").read_text())["parts"]] == [
        "new",
        "archive",
        "aug",
    ]
    # parts of another preset cannot share a report
    Study(tmp_path / "m30k", "multi30k_en_de", settings=["rope"], seeds=[1]).save()
    assert main([*argv[:2], "--include", str(tmp_path / "m30k"), "--out", str(tmp_path / "x")]) == 2
    assert "has preset='multi30k_en_de'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_seed_the_baseline_lacks_is_named_not_paired(tmp_path: Path) -> None:
    """A third seed of one setting in another study (the baseline has two): the row's mean takes all
    three, its test against the baseline names the two seeds it pairs, and the third is listed as
    unpaired rather than dropped without a word."""
    base = Study(tmp_path / "base", "demo", settings=["sinusoidal", "rope"], seeds=[1, 2])
    more = Study(tmp_path / "more", "demo", settings=["rope"], seeds=[3])
    for study in (base, more):
        study.save()
    wrong = [r if i % 4 else "a dog" for i, r in enumerate(REFS)]
    for seed in (1, 2):
        _finished(base, "sinusoidal", seed, 50.0, wrong)
        _finished(base, "rope", seed, 60.0, REFS)
    _finished(more, "rope", 3, 63.0, REFS)
    out = tmp_path / "combined"
    assert main(["report", str(base.root), "--include", str(more.root), "--out", str(out)]) == 0
    paired = json.loads((out / "summary.json").read_text())["settings"]["rope"]["paired"]
    assert sorted(paired["per_seed"]) == ["1", "2"] and paired["seeds_without_baseline"] == [3]
    report = (out / "report.md").read_text()
    row = next(line for line in report.splitlines() if line.startswith("| `rope` | 3 | 61.0 ± 1.7 |"))
    assert row.count("; seeds 1, 2)") == 2  # BLEU and chrF
    assert "| `rope` | 3 | no `sinusoidal` run of this seed: not paired |" in report
    assert "| `rope` | pooled (1, 2) |" in report
