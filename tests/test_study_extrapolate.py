"""``tpe-study extrapolate``: the grid of checkpoints x test-time position methods x test sets, the
baseline against plain tpe-eval, the bootstrap intervals against a bootstrap computed here, the cache,
the errors before any decoding, and the report's table against its JSON. One tiny study (rope with two
seeds, learned with one) trained in this process once for the module."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from sacrebleu.metrics import BLEU
from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

from tpe_train.evaluation.cli import eval_main
from tpe_train.evaluation.decoding import read_lines
from tpe_train.evaluation.evaluate import EvalFiles, concatenated, config_sets
from tpe_train.evaluation.metrics import paired_bootstrap
from tpe_train.study import extrapolate as ex
from tpe_train.study.cli import main
from tpe_train.study.grid import Study, StudyError, parse_setting
from tpe_train.study.position_methods import Method, methods_of

pytestmark = pytest.mark.slow

PNG = b"\x89PNG\r\n\x1a\n"
TINY = [
    "data.synthetic.train_size=300",
    "data.synthetic.valid_size=10",
    "data.synthetic.test_size=24",
    "data.synthetic.long_size=1",
    "data.synthetic.probe_size=2",
    "data.synthetic.max_words=8",
    "data.vocab_size=120",
    "data.max_tokens=1024",
    "data.max_len=38",
    "model.d_model=32",
    "model.ffn_dim=64",
    "model.encoder_layers=1",
    "model.decoder_layers=1",
    "model.position.max_positions=40",  # the 2-sentence segments reach past it: some left untranslated
    "train.max_steps=40",
    "train.lr=0.01",
    "train.warmup_steps=5",
    "train.save_every=0",
    "train.valid_every=1000",
    "train.valid_bleu_size=0",
    "eval.beam=1",
    "eval.length_buckets=[4,8,16]",
    "train.threads=1",  # a tiny model: one thread is faster than two, and much faster on a busy machine
]
ASKED = ["--methods", "rope-yarn,learned-interpolate", "--factors", "2", "--concat", "2", "--samples", "100",
         "--device", "cpu"]  # fmt: skip


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Study:
    """rope seeds 1 and 2, learned seed 1: trained here, in process (a few seconds each)."""
    from tpe_train.train.loop import run

    root = tmp_path_factory.mktemp("extrapolate") / "study"
    study = Study(
        root, "demo", TINY, ["rope", "learned"], [1, 2], cells=[["rope", 1], ["learned", 1], ["rope", 2]]
    )
    study.save()
    threads = torch.get_num_threads()
    for setting, seed in study.grid():
        run(study.config(setting, seed))
    torch.set_num_threads(threads)  # training set train.threads
    return study


@pytest.fixture(scope="module")
def extrapolated(study: Study) -> Path:
    """The study extrapolated with yarn x2 and learned interpolation x2 on test and test+x2."""
    threads = torch.get_num_threads()
    assert main(["extrapolate", str(study.root), *ASKED]) == 0
    assert torch.get_num_threads() == threads  # decoding took train.threads, then gave them back
    return study.root / "extrapolate"


def export(study: Study, kind: str, seed: int) -> Path:
    return study.run_dir(parse_setting(kind), seed) / "checkpoint"


def summary(out: Path) -> dict:
    return json.loads((out / "report" / "summary.json").read_text())


def test_the_default_grid_is_every_applicable_method_x_factor_x_set(study: Study) -> None:
    checkpoints = ex.study_exports(study)
    assert [(p, label, group, seed) for p, label, group, seed in checkpoints] == [
        (export(study, "rope", 1), "rope-s1", "rope", 1),
        (export(study, "learned", 1), "learned-s1", "learned", 1),
        (export(study, "rope", 2), "rope-s2", "rope", 2),
    ]
    methods = methods_of(None, [2.0, 4.0], ["both"], [])
    plan = ex.make_plan(study.root / "x", checkpoints, methods, ex.SetSpec(), explicit=False)
    grid = {(c.checkpoint.label, c.method.name, c.test_set.name): c.items for c in plan.cells}
    rope = ["baseline"] + [f"rope-{m}-x{s}" for m in ("pi", "ntk", "yarn") for s in (2, 4)]
    learned = ["baseline", "learned-interpolate-x2", "learned-interpolate-x4"]
    sets = ["test", "test+x2", "test+x3"]
    expected = {(label, m, t) for label, ms in (("rope-s1", rope), ("rope-s2", rope), ("learned-s1", learned))
                for m in ms for t in sets}  # fmt: skip
    assert set(grid) == expected and len(plan.cells) == len(expected) == 51
    assert grid["rope-s1", "rope-yarn-x4", "test+x2"] == ["rope.scaling=yarn", "rope.factor=4"]
    assert grid["rope-s2", "rope-ntk-x2", "test"] == ["rope.scaling=ntk", "rope.factor=2"]
    assert grid["learned-s1", "learned-interpolate-x2", "test+x3"] == [
        "learned.extend=interpolate",
        "learned.factor=2",
    ]
    assert grid["rope-s1", "baseline", "test"] == []
    # the methods of encodings the study lacks are left out when none were named
    assert not any(c.method.family in ("alibi-slope", "t5-distance") for c in plan.cells)
    # the sets: the model's test split and its 2- and 3-sentence segments, from the corpus itself
    _, cfg, _ = ex.load_export(export(study, "rope", 1))
    (test,) = config_sets(cfg.data)
    by_name = {t.name: t for t in plan.sets["rope-s1"]}
    assert by_name["test"].pairs == test.pairs and by_name["test+x3"].pairs == concatenated(test, 3).pairs
    # named methods, factors and sides: exactly those; alibi and t5 settings from the config
    methods = methods_of(["rope-yarn"], [3.0], ["encoder", "both"], ["mine=rope.scaling=pi,rope.factor=5"])
    plan = ex.make_plan(study.root / "x", checkpoints[:1], methods, ex.SetSpec(concat=(2,)))
    assert sorted({(c.method.name, c.test_set.name, " ".join(c.items)) for c in plan.cells}) == sorted(
        (name, t, items)
        for name, items in [
            ("baseline", ""),
            ("rope-yarn-x3", "rope.scaling=yarn rope.factor=3"),
            ("rope-yarn-x3@encoder", "side=encoder rope.scaling=yarn rope.factor=3"),
            ("mine", "rope.scaling=pi rope.factor=5"),
        ]
        for t in ("test", "test+x2")
    )
    cfg.model.position.t5_max_distance = 96
    assert Method("t5-distance-x2", "t5-distance", 2.0).items(cfg) == ["t5.max_distance=192"]
    assert Method("alibi-slope-x4", "alibi-slope", 4.0).items(cfg) == ["alibi.slope_scale=0.25"]
    for kind in ("kerple_log", "kerple_power", "sandwich"):
        assert Method("d", f"{kind}-distance", 2.0).items(cfg) == [f"{kind}.distance_scale=2"]
    assert Method("x", "xpos-yarn", 4.0, original=32).items(cfg) == [
        "xpos.scaling=yarn", "xpos.factor=4", "xpos.original=32"
    ]  # fmt: skip
    assert Method("x", "xpos-ntk", 2.0, side="decoder").items(cfg) == [
        "side=decoder", "xpos.scaling=ntk", "xpos.factor=2"
    ]  # fmt: skip


def test_the_baseline_is_plain_tpe_eval_of_the_same_checkpoint(
    study: Study, extrapolated: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = export(study, "rope", 2)
    assert eval_main(["--checkpoint", str(ckpt), "--concat", "2", "--json", "--out", str(tmp_path)]) == 0
    plain = json.loads(capsys.readouterr().out)["sets"]
    figures = summary(extrapolated)["sets"]
    for name in ("test", "test+x2"):
        cell = EvalFiles(extrapolated / "cells" / "rope-s2" / "baseline" / name)
        kept = cell.read_figures()
        assert kept is not None
        for key in ("bleu", "chrf", "exact_match", "test_sentences"):
            assert kept[key] == plain[name][key], (name, key)
        if name == "test+x2":  # tpe-eval's plain test set also scores the synthetic long pairs by length
            assert kept["bleu_by_length"] == plain[name]["bleu_by_length"]
        assert cell.read_set(name) == EvalFiles(tmp_path).read_set(name)  # the same translations
        whole = figures[name]["rope"]["baseline"]["buckets"]["all"]["per_checkpoint"]["rope-s2"]
        assert whole["bleu"]["system"] == pytest.approx(plain[name]["bleu"], abs=1e-9)
        assert whole["chrf"]["system"] == pytest.approx(plain[name]["chrf"], abs=1e-9)
        assert whole["bleu"]["p_value"] == 1.0  # the baseline against itself
    assert figures["test"]["rope"]["baseline"]["checkpoints"] == ["rope-s1", "rope-s2"]


def test_intervals_hold_the_score_and_match_a_bootstrap_computed_here(
    study: Study, extrapolated: Path
) -> None:
    figures = summary(extrapolated)["sets"]
    for groups in figures.values():
        for methods in groups.values():
            for row in methods.values():
                for tests in row["buckets"].values():
                    for key in ("bleu", "chrf"):
                        f = tests[key]
                        slack = 1e-6 * max(1.0, f["score"])  # sacreBLEU resamples float32 statistics
                        assert f["low"] - slack <= f["score"] <= f["high"] + slack, f
    # rope seed 1, yarn x2, the 9-16-word bucket of test+x2 (beyond the 8 training words): the bucket's
    # sentences by their source words, then 100 resamples drawn as sacreBLEU draws them (its seed
    # 12345), BLEU of each, and the 2.5th / 97.5th percentiles
    _, cfg, _ = ex.load_export(export(study, "rope", 1))
    (test,) = config_sets(cfg.data)
    pairs = concatenated(test, 2).pairs
    members = [i for i, (src, _) in enumerate(pairs) if 9 <= len(src.split()) <= 16]
    hyps, refs = EvalFiles(extrapolated / "cells/rope-s1/rope-yarn-x2/test+x2").read_set("test+x2") or (
        [],
        [],
    )
    assert refs == [ref for _, ref in pairs] and len(members) >= 8
    h, r = [hyps[i] for i in members], [refs[i] for i in members]
    draws = np.random.default_rng(12345).choice(len(h), size=(100, len(h)), replace=True)
    scores = np.sort(
        [BLEU(force=True).corpus_score([h[i] for i in d], [[r[i] for i in d]]).score for d in draws]
    )
    lower, upper = scores[100 // 40], scores[100 - 100 // 40 - 1]
    got = figures["test+x2"]["rope"]["rope-yarn-x2"]["buckets"]["9-16"]
    assert got["sentences"] == 2 * len(members)  # both seeds' sentences, pooled
    mine = got["per_checkpoint"]["rope-s1"]["bleu"]
    assert mine["system_ci95"] == pytest.approx((upper - lower) / 2, rel=1e-4, abs=1e-6)
    assert mine["system_mean"] == pytest.approx(scores.mean(), rel=1e-4, abs=1e-6)
    # pooled as the study report pools seeds: both seeds' sentences, each with its own baseline's
    parts: list[list[str]] = [[], [], []]
    for seed in (1, 2):
        cells = extrapolated / f"cells/rope-s{seed}"
        sys_, refs_ = EvalFiles(cells / "rope-yarn-x2/test+x2").read_set("test+x2") or ([], [])
        base, _ = EvalFiles(cells / "baseline/test+x2").read_set("test+x2") or ([], [])
        for part, lines in zip(parts, (sys_, base, refs_), strict=True):
            part += [lines[i] for i in members]
    pooled = paired_bootstrap(*parts, samples=100)
    # the output length: the pooled translations' 13a tokens over the references'
    words = [sum(len(Tokenizer13a()(line).split()) for line in lines) for lines in (parts[0], parts[2])]
    assert got["length_ratio"] == pytest.approx(words[0] / words[1], rel=1e-12)
    for key in ("bleu", "chrf"):
        assert got["pooled"][key] == pytest.approx(pooled.metrics[key].as_dict())
        assert got[key]["delta"] == pytest.approx(pooled.metrics[key].delta)


def test_a_rerun_decodes_only_cells_it_has_not_kept(study: Study, extrapolated: Path) -> None:
    methods = methods_of(["rope-yarn", "learned-interpolate"], [2.0], ["both"], [])
    plan = ex.make_plan(extrapolated, ex.study_exports(study), methods, ex.SetSpec(concat=(2,)), samples=100)
    assert len(plan.cells) == 12 and all(c.done() for c in plan.cells)
    stamps = {c.directory: (c.files.figures.stat().st_mtime_ns) for c in plan.cells}
    lines: list[str] = []
    assert ex.run_plan(plan, torch.device("cpu"), lines.append) == (0, 12)
    assert {c.directory: c.files.figures.stat().st_mtime_ns for c in plan.cells} == stamps
    gone, stale = plan.cells[1], plan.cells[-1]
    gone.files.figures.unlink()
    figures = json.loads(stale.files.figures.read_text())
    figures["extrapolate"]["decoding"]["beam"] = 4  # kept from another decoding: not this cell
    stale.files.figures.write_text(json.dumps(figures))
    before = read_lines(stale.files.hypotheses(stale.test_set.name))
    assert ex.run_plan(plan, torch.device("cpu"), lines.append) == (2, 10)
    assert all(c.done() for c in plan.cells)
    assert read_lines(stale.files.hypotheses(stale.test_set.name)) == before  # greedy again: the same


def test_exports_given_one_by_one_from_a_study_layout_pool_as_the_study_does(tmp_path: Path) -> None:
    """--checkpoint: STUDY/runs/s<seed>/<setting>/<export> gets the study's label and row; a second
    export of the same run and any other path are rows of their own, never named like a setting."""
    study = tmp_path / "study" / "runs"
    paths = [study / "s1" / "rope" / "averaged-last5", study / "s2" / "rope" / "checkpoint",
             study / "s1" / "rope" / "checkpoint", tmp_path / "elsewhere" / "rope" / "checkpoint",
             tmp_path / "s3" / "alibi" / "checkpoint"]  # fmt: skip
    rows = [(label, row, seed) for _, label, row, seed in ex.checkpoint_rows(paths)]
    assert rows == [("rope-s1", "rope", 1), ("rope-s2", "rope", 2), ("rope-2", "rope-2", None),
                    ("rope-3", "rope-3", None), ("alibi", "alibi", None)]  # fmt: skip


def test_labels_given_with_the_checkpoints_name_their_rows(
    study: Study, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--label: each export its own row of that name, a study's layout included; a wrong count, a
    repeated label or one that cannot name a folder is an error before anything runs."""
    out = tmp_path / "out"
    argv = ["--checkpoint", str(export(study, "rope", 1)), "--label", "rope-long", "--methods", "rope-yarn"]
    assert main(["extrapolate", *argv, "--dry-run", "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith("rope-long (")  # the plan's row, not rope-s1
    paths = [tmp_path / "study" / "runs" / "s1" / "rope" / "checkpoint", tmp_path / "b" / "checkpoint"]
    rows = [(label, row, seed) for _, label, row, seed in ex.checkpoint_rows(paths, ["long", "short-1.5"])]
    assert rows == [("long", "long", None), ("short-1.5", "short-1.5", None)]
    for labels, message in (
        (["one"], "1 --label for 2 --checkpoint"),
        (["same", "same"], "'same' is given twice"),
        (["a/b", "c"], "'a/b' is not a usable name"),
        ([".hidden", "c"], "'.hidden' is not a usable name"),
    ):
        with pytest.raises(StudyError, match=re.escape(message)):
            ex.checkpoint_rows(paths, labels)


def test_bad_input_stops_before_any_decoding(
    study: Study, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rope = str(export(study, "rope", 1))
    out = tmp_path / "out"
    cases = [
        (["--checkpoint", rope, "--methods", "alibi-slope"],
         ["method alibi-slope changes alibi", "rope-s1 uses rope (methods: rope-pi, rope-ntk, rope-yarn)"]),
        (["--checkpoint", rope, "--methods", "rope-yarn", "--sides", "cross"],
         ["method rope-yarn changes rope (cross)", "which no checkpoint uses there"]),
        (["--checkpoint", rope, "--methods", "rope-warp"],
         ["rope-warp is not a method", "rope: rope-pi, rope-ntk, rope-yarn", "alibi: alibi-slope"]),
        (["--checkpoint", str(tmp_path / "nothing")], ["checkpoint nothing", "not a tpe-train checkpoint"]),
        (["--checkpoint", rope, "--factors", "1,2"], ["1 is not above 1"]),
        (["--checkpoint", rope, "--custom", "x=rope.scaling=warp"], ["rope.scaling='warp'"]),
        (["--checkpoint", rope, "--split", "dev"], ["no split 'dev'"]),
        ([str(tmp_path)], ["is not a study directory"]),
        ([], ["give a study directory or --checkpoint"]),
        (["--checkpoint", rope, "--label", "a", "--label", "b"], ["2 --label for 1 --checkpoint"]),
        ([str(tmp_path), "--label", "a"], ["--label names --checkpoint exports"]),
    ]  # fmt: skip
    for argv, messages in cases:
        assert main(["extrapolate", *argv, "--out", str(out)]) == 2, argv
        err = capsys.readouterr().err
        assert all(m in err for m in messages) and "Traceback" not in err, (argv, err)
        assert not out.exists()  # nothing decoded, nothing written
    # a study with runs that have no weights (an archive, unfinished runs) names them
    archive = tmp_path / "archive"
    Study(archive, "demo", TINY, ["rope"], [1]).save()
    assert main(["extrapolate", str(archive)]) == 2
    assert "1 runs have no exported weights: rope seed 1" in capsys.readouterr().err


def test_the_report_table_is_the_json_and_the_plots_exist(extrapolated: Path) -> None:
    report = (extrapolated / "report" / "report.md").read_text()
    data = summary(extrapolated)
    assert data["checkpoints"]["rope-s2"]["seed"] == 2 and data["training_cap"] == 8
    assert data["methods"]["rope-yarn-x2"]["position"]["rope-s1"] == ["rope.scaling=yarn", "rope.factor=2"]
    assert data["not_applied"]["rope-yarn-x2"] == ["learned-s1"]
    checked = 0
    sections = re.split(r"^## `([^`]+)`.*$", report, flags=re.M)
    for name, body in zip(sections[1::2], sections[2::2], strict=True):
        for title, key in (("BLEU", "bleu"), ("chrF", "chrf")):
            table = body.split(f"### {title}\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
            header = [h.strip().rstrip(" †") for h in table[0].strip("|").split("|")]
            assert header[:3] == ["setting", "method", "checkpoints"]
            for line in table[2:]:
                cells = [c.strip() for c in line.strip("|").split("|")]
                group, method = cells[0].strip("`"), cells[1].strip("`")
                row = data["sets"][name][group][method]
                assert cells[2] == str(len(row["checkpoints"]))
                for bucket, cell in zip(header[3:], cells[3:], strict=True):
                    tests = row["buckets"][bucket]
                    f = tests[key]
                    text = f"{f['score']:.1f} ± {f['ci95']:.1f}"
                    if method != "baseline":
                        p = "< 0.001" if f["p_value"] < 0.001 else f"{f['p_value']:.3f}"
                        text += f" ({f['delta']:+.1f}, p {p})"
                    assert cell == text + ("*" if tests["untranslated"] else ""), (name, method, bucket)
                    checked += 1
        table = body.split("### Output length\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
        header = [h.strip().rstrip(" †") for h in table[0].strip("|").split("|")]
        for line in table[2:]:
            cells = [c.strip() for c in line.strip("|").split("|")]
            row = data["sets"][name][cells[0].strip("`")][cells[1].strip("`")]
            for bucket, cell in zip(header[3:], cells[3:], strict=True):
                assert cell == f"{row['buckets'][bucket]['length_ratio']:.2f}", (name, cells[1], bucket)
                checked += 1
    cells = sum(len(row["buckets"]) for groups in data["sets"].values() for rows in groups.values()
                for row in rows.values())  # fmt: skip
    assert checked == 3 * cells and cells >= 4 * (3 + 3)  # BLEU, chrF, length; 4 rows, all + 2 buckets
    assert "9-16 †" in report  # beyond the 8 training words
    # the learned table (40 rows) cannot hold the longest segments: untranslated there, marked
    assert data["sets"]["test+x2"]["learned"]["baseline"]["buckets"]["all"]["untranslated"] > 0
    for group in ("rope", "learned"):
        png = extrapolated / "report" / f"extrapolation_{group}.png"
        assert png.read_bytes().startswith(PNG) and f"]({png.name})" in report
    assert list((extrapolated / "report" / "tb").glob("events.out.tfevents.*"))
