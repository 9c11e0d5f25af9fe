"""The demo preset end to end: a few steps, TensorBoard events read back, the checkpoint, tpe-eval."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tpe_train.ckpt.export import load_export

pytestmark = pytest.mark.integration  # every test here starts the project's commands

TINY = [
    "data.synthetic.train_size=400",
    "data.synthetic.valid_size=20",
    "data.synthetic.test_size=30",
    "data.synthetic.long_size=10",
    "data.synthetic.probe_size=10",
    "data.vocab_size=200",
    "data.max_tokens=1024",
    "model.d_model=32",
    "model.ffn_dim=64",
    "model.encoder_layers=1",
    "model.decoder_layers=1",
    "train.max_steps=6",
    "train.log_every=2",
    "train.valid_every=3",
    "train.valid_bleu_size=5",
    "train.progress=false",
    "eval.beam=2",
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo") / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "tpe_train.train", "--preset", "demo", *TINY, f"train.run_dir={out}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "word-order probe accuracy" in proc.stdout  # the closing table
    (out / "stdout.txt").write_text(proc.stdout)
    return out


def test_run_dir_holds_config_events_and_checkpoint(run_dir: Path) -> None:
    assert (run_dir / "config.yaml").is_file()
    ckpt = run_dir / "checkpoint"
    for name in ("model.safetensors", "config.yaml", "tokenizer.json", "meta.json"):
        assert (ckpt / name).is_file(), name
    model, cfg, tok = load_export(ckpt)
    assert cfg.train.max_steps == 6 and cfg.model.d_model == 32
    assert tok.get_vocab_size() == 200
    assert model.args.vocab_size == 200


def test_tensorboard_events_read_back(run_dir: Path) -> None:
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_s",
        "train/mfu",
        "valid/nll",
        "valid/bleu",
        "test/bleu",
        "test/probe_accuracy",
    }
    assert expected <= tags
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6]
    assert [e.step for e in events.Scalars("valid/nll")] == [3, 6]
    lrs = [e.value for e in events.Scalars("train/lr")]
    assert lrs == sorted(lrs) and lrs[0] > 0  # still warming up
    # model FLOP/s over the GEMM peak measured at start-up: a fraction, never above one
    mfu = [e.value for e in events.Scalars("train/mfu")]
    assert len(mfu) == 3 and all(0 < m <= 1 for m in mfu), mfu


def test_without_a_progress_bar_the_log_gets_a_line_per_log_every_and_validation(run_dir: Path) -> None:
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    lines = (run_dir / "stdout.txt").read_text().splitlines()
    train = [line for line in lines if line.startswith("tpe-train: step ") and "| loss " in line]
    valid = [line for line in lines if line.startswith("tpe-train: step ") and "| valid nll " in line]
    assert [line.split()[2] for line in train] == ["2/6", "4/6", "6/6"]
    assert [line.split()[2] for line in valid] == ["3/6", "6/6"]
    for line, event in zip(train, events.Scalars("train/loss"), strict=True):
        assert f"| loss {event.value:.3f} |" in line
        assert "| tok/s " in line and "| mfu " in line and "%" in line
    for line, event in zip(valid, events.Scalars("valid/nll"), strict=True):
        assert f"| valid nll {event.value:.3f} |" in line and "| valid bleu " in line


def test_tpe_eval_json(run_dir: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tpe_train.evaluation",
            "--checkpoint",
            str(run_dir / "checkpoint"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout)
    for key in ("bleu", "bleu_signature", "chrf", "exact_match", "probe_accuracy", "bleu_by_length"):
        assert key in figures
    assert figures["bleu_signature"].startswith("nrefs:1|case:mixed")
    assert figures["probe_pairs"] == 10 and figures["test_sentences"] == 30
    assert 0.0 <= figures["probe_accuracy"] <= 1.0
    # the same figures as the end of training (same model, same deterministic decoding)
    trained = json.loads((run_dir / "eval.json").read_text())
    assert figures["bleu"] == pytest.approx(trained["bleu"])


def test_tpe_eval_rejects_a_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tpe_train.evaluation", "--checkpoint", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "is not a tpe-train checkpoint" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("device", ["cuda:99", "potato"])
def test_tpe_eval_refuses_a_device_it_cannot_use(
    run_dir: Path, device: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command's ``main`` in this process (the exit status and stderr of a refusal as a process:
    the test above)."""
    from tpe_train.evaluation.cli import eval_main

    code = eval_main(["--checkpoint", str(run_dir / "checkpoint"), "--device", device])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert f"--device {device}" in err and "use auto, cpu" in err
    assert "Traceback" not in err


def test_validation_leaves_out_pairs_longer_than_a_learned_table(tmp_path: Path) -> None:
    """data.max_len bounds training pairs and the learned table; the validation set is not filtered
    when it is built, so validation must leave its longer pairs out instead of indexing past the table."""
    overrides = [
        *TINY,
        "model.position.kind=learned",
        "data.max_len=30",
        "model.position.max_positions=31",
        "train.valid_bleu_size=20",
        "eval.at_end=false",
        f"train.run_dir={tmp_path / 'run'}",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "tpe_train.train", *overrides], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoint" / "model.safetensors").exists()
