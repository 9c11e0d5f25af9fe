"""The ``wmt14_en_de_base`` preset end to end on a corpus in the Hugging Face ``wmt14`` parquet layout that
the test writes: ``tpe-data prepare`` (the preset's ``data.num_proc``), training that is stopped and
resumed, the preset's final model (the mean of the last 5 checkpoints), its evaluation, and ``tpe-eval
--limit`` on that export. Only the model is shrunk (and the vocabulary, for a corpus of 2,000 pairs); the
data, schedule, checkpoint and evaluation settings are the preset's. docs/wmt14.md runs the same commands
at full size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_checkpoints import steps_of
from test_sources import write_hub_layout

from tpe_train.data import synthetic

pytestmark = pytest.mark.integration  # every test here starts the project's commands

SMALL_MODEL = [
    "model.d_model=32",
    "model.n_heads=4",
    "model.ffn_dim=64",
    "model.encoder_layers=1",
    "model.decoder_layers=1",
    "data.vocab_size=400",
    "data.max_tokens=1500",
    "train.threads=1",
]
SCHEDULE = ["train.save_every=2", "train.valid_every=10", "train.valid_bleu_size=20", "train.log_every=5"]


def _write_corpus(root: Path) -> None:
    """Train, validation and test splits of synthetic sentence pairs, two parquet shards for train."""
    pairs = synthetic.generate(2200, seed=3, min_words=3, max_words=14)
    write_hub_layout(root, "train", pairs[:2000], shards=2)
    write_hub_layout(root, "validation", pairs[2000:2100], shards=1)
    write_hub_layout(root, "test", pairs[2100:], shards=1)


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def test_wmt14_base_preset_prepares_trains_resumes_averages_and_evaluates(tmp_path: Path) -> None:
    corpus, store, run = tmp_path / "wmt14", tmp_path / "store", tmp_path / "run"
    _write_corpus(corpus)
    data = ["data.corpus=parquet", f"data.path={corpus}", f"data.store_dir={store}"]
    prepared = _run(
        "tpe_train.data.cli", "prepare", "--preset", "wmt14_en_de_base", *data, "data.vocab_size=400"
    )
    assert "built" in prepared.stdout and "2000 training pairs" in prepared.stdout
    args = ["--preset", "wmt14_en_de_base", *data, *SMALL_MODEL, *SCHEDULE, f"train.run_dir={run}"]
    first = _run("tpe_train.train", *args, "train.max_steps=10", "eval.at_end=false")
    assert "token store" in first.stdout and "(reused)" in first.stdout  # tpe-data's store, not a rebuild
    assert steps_of(run) == [2, 4, 6, 8, 10]
    second = _run("tpe_train.train", *args, "train.max_steps=20")
    assert "resumed from" in second.stdout and "at step 10" in second.stdout
    assert steps_of(run) == [12, 14, 16, 18, 20]  # the preset's keep_last=5
    # the preset's final model: the mean of the last five checkpoints, exported and evaluated
    final = run / "averaged-last5"
    assert (final / "model.safetensors").is_file()
    figures = json.loads((run / "eval.json").read_text())
    assert figures["test_sentences"] == 100 and 0 <= figures["bleu"] <= 100
    assert "bleu_tokenized" in figures  # the papers' figure beside sacreBLEU, as the preset promises
    limited = _run(
        "tpe_train.evaluation", "--checkpoint", str(final), "--limit", "30", "--beam", "2", "--json"
    )
    result = json.loads(limited.stdout)
    assert list(result["sets"]) == ["test[:30]"] and result["test_sentences"] == 30
