"""A run's ``eval.json`` read back by ``tpe-study report`` and ``tpe-study extrapolate``: a study archive is
handed on, and a file may be damaged, so random bytes, random JSON or the real figures with one value
or key replaced either read or give one ``MemberError`` naming the file (``tpe-study`` prints it and
exits 2), never a ``KeyError``, ``TypeError`` or a format error. A chosen export's name in the figures
(``selected.export``) is a plain name inside the run directory. Derandomized: the same ``EXAMPLES``
each run (docs/reliability.md counts them with the other reader fuzz tests)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tests.support.fuzz import drawn, fuzz, outcome
from tpe_train.run.members import MemberError
from tpe_train.study.cli import main
from tpe_train.study.extrapolate import study_exports
from tpe_train.study.grid import Study, StudyError, parse_setting
from tpe_train.study.plots import make_figures
from tpe_train.study.report import markdown, summary
from tpe_train.study.results import aggregate, gather, significance

EXAMPLES = 100
SETTINGS, SEEDS = ["rope", "learned"], [1, 2]


def figures(bleu: float) -> dict[str, object]:
    """An evaluation's figures as ``tpe-eval`` writes them (one set; its copy under ``sets``)."""
    one = {
        "test_set": "test",
        "bleu": bleu,
        "bleu_signature": "nrefs:1|tok:13a",
        "chrf": 2 * bleu,
        "exact_match": 0.25,
        "probe_accuracy": 0.5,
        "probe_pairs": 4,
        "test_sentences": 20,
        "too_long": 1,
        "bleu_by_length": {
            "1-10": {"sentences": 10, "bleu": bleu},
            "11+": {"sentences": 10, "bleu": None, "unrepresentable": 10},
        },
    }
    return {**one, "sets": {"test": one}, "selected": {"select": "best", "export": "/elsewhere/run/best"}}


def make_study(root: Path) -> Study:
    study = Study(root, "demo", settings=SETTINGS, seeds=SEEDS)
    study.save()
    for i, (setting, seed) in enumerate(study.grid()):
        path = study.eval_path(setting, seed)
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(figures(10.0 + i), indent=2))
    return study


def report_reads(study: Study) -> None:
    """Everything ``tpe-study report`` computes from the figures (all but drawing and writing files)."""
    runs = gather(study)
    rows = aggregate(study, runs)
    tests = significance(study, runs)
    _, notes = make_figures(study, runs, rows, 16)
    markdown(study, runs, rows, [], notes, tests)
    json.dumps(summary(study, rows, tests), allow_nan=False)


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Study:
    return make_study(tmp_path_factory.mktemp("study"))


@fuzz(EXAMPLES)
@given(data=st.data())
@example(data=b'{"bleu": NaN}').via("a score that is not a finite number")
@example(data=b'{"bleu": 1, "bleu_by_length": {"1-10": {"bleu": true, "sentences": 3}}}').via("a boolean")
@example(data=b'{"bleu": 1, "sets": {"test": []}}').via("a set's figures that are a list")
@example(data=b'{"bleu": 1, "selected": {"export": ".."}}').via("a chosen export outside the run")
def test_an_eval_json_of_random_bytes_reads_or_gives_a_member_error(
    study: Study, data: st.DataObject | bytes
) -> None:
    setting = parse_setting(SETTINGS[0])
    path = study.eval_path(setting, SEEDS[0])
    real = json.dumps(figures(10.0), indent=2).encode()
    path.write_bytes(data if isinstance(data, bytes) else drawn(data, "eval.json", real))
    try:
        outcome(lambda: report_reads(study), (MemberError,))
        # extrapolate's list of exports reads the same figures; a run without weights is a StudyError
        assert outcome(lambda: study_exports(study), (MemberError, StudyError)) != "read"
    finally:
        path.write_bytes(real)


@pytest.mark.parametrize(
    ("content", "names"),
    [
        (b'{"bleu": NaN}', "'bleu' is nan, where a finite number"),
        (b'{"bleu": 1, "probe_pairs": true}', "'probe_pairs' is True, where a non-negative integer"),
        (b'{"bleu": 1, "bleu_by_length": []}', "'bleu_by_length' is [], where an object of buckets"),
        (b'{"chrf": 1}', "'bleu' is missing, where a number"),
        (b'{"bleu": 1, "sets": {"test": {"bleu": "high"}}}', "'sets'.'test'.'bleu' is 'high'"),
        (b'{"bleu": 1, "selected": {"export": "/x/.."}}', "names the file '..', which points outside"),
        (b"[1, 2]", "holds a JSON list, where an object is expected"),
        (b'{"bleu": 1' + b" " * 10, "is not valid JSON"),
    ],
)
def test_a_damaged_eval_json_is_one_error_naming_the_file_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, names: str
) -> None:
    study = make_study(tmp_path / "study")
    path = study.eval_path(parse_setting("learned"), 2)
    path.write_bytes(content)
    read = study_exports if b"selected" in content else report_reads  # the report leaves it unread
    with pytest.raises(MemberError) as caught:
        read(study)
    assert str(path) in str(caught.value) and names in str(caught.value)
    assert "tpe-eval" in str(caught.value) or "use another copy" in str(caught.value)  # the fix
    if read is study_exports:
        return
    assert main(["report", str(study.root)]) == 2  # the command: the message, no traceback
    err = capsys.readouterr().err
    assert str(path) in err and "Traceback" not in err
    assert not study.report_dir.exists()  # nothing half-written


def test_the_figures_of_a_real_evaluation_read_back_unchanged(tmp_path: Path) -> None:
    study = make_study(tmp_path / "study")
    read = study.eval_files(parse_setting("rope"), 1).read_figures()
    assert read == figures(10.0)
    assert not any(isinstance(v, float) and not math.isfinite(v) for v in (read or {}).values())
