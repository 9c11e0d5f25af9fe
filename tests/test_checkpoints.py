"""Training checkpoints in one process: saving and pruning, exact resume, preemption signals, incomplete
and tampered checkpoints, foreign configs and tokenizers, a full disk, and tpe-ckpt."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from tpe_train.ckpt_store import entries, sha256

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "data.synthetic.train_size=1500",
    "data.synthetic.test_size=40",
    "data.synthetic.valid_size=60",
    "data.synthetic.long_size=10",
    "data.synthetic.probe_size=10",
    "eval.at_end=false",
    "train.valid_bleu_size=0",
    "train.progress=false",
    "train.log_samples=true",
    "train.threads=1",
    "model.dropout=0.1",  # dropout draws random numbers: exact resume must restore the generators
]


def train(run_dir: Path, *overrides: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tpe_train.train", *SMALL, f"train.run_dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def steps_of(run_dir: Path) -> list[int]:
    return [e.step for e in entries(run_dir / "checkpoints") if e.complete]


def samples(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples" / "rank-00000.jsonl").read_text().splitlines()]


def weights(path: Path) -> dict:
    return load_file(str(path / "model.safetensors"))


def test_saving_keeps_the_last_k_and_every_mth_with_a_manifest(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(run, "train.max_steps=10", "train.save_every=2", "train.keep_last=2", "train.keep_every=4")
    assert steps_of(run) == [4, 8, 10]  # the last two, and every multiple of 4
    root = run / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-00000010"
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]
    manifest = json.loads((root / "step-00000010" / "manifest.json").read_text())
    expected = {"model.safetensors", "optimizer.safetensors", "trainer.json", "rank-00000.json"}
    assert expected <= set(manifest["files"])
    for name, info in manifest["files"].items():
        assert sha256(root / "step-00000010" / name) == info["sha256"], name
    trainer = json.loads((root / "step-00000010" / "trainer.json").read_text())
    assert trainer["step"] == 10 and trainer["adam_steps"] == 10 and trainer["tokens"] > 0
    assert trainer["layout"] == {"world_size": 1, "tp_size": 1, "dp_size": 1, "zero_stage": None}


def test_n_steps_resume_n_steps_equals_2n_steps_bitwise(tmp_path: Path) -> None:
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    train(whole, "train.max_steps=12", "train.save_every=0")
    train(halves, "train.max_steps=6", "train.save_every=0")
    proc = train(halves, "train.max_steps=12", "train.save_every=0")
    assert "resumed from" in proc.stdout and "at step 6" in proc.stdout
    a, b = weights(whole / "checkpoints/step-00000012"), weights(halves / "checkpoints/step-00000012")
    assert all((a[k] == b[k]).all() for k in a)  # bitwise
    a6 = weights(halves / "checkpoints/step-00000006")
    assert any((a[k] != a6[k]).any() for k in a)  # and the second half did train
    opt_a = load_file(str(whole / "checkpoints/step-00000012/optimizer.safetensors"))
    opt_b = load_file(str(halves / "checkpoints/step-00000012/optimizer.safetensors"))
    assert all((opt_a[k] == opt_b[k]).all() for k in opt_a)
    assert samples(whole) == samples(halves)  # the same batches, in the same order


def test_preemption_saves_and_exits_for_requeue_and_the_rerun_finishes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "tpe_train.train", *SMALL, f"train.run_dir={run}", "train.max_steps=400"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = run / "samples" / "rank-00000.jsonl"
    deadline = time.time() + 300
    while not (log.exists() and len(log.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    saving = run / "checkpoints"
    while not any(p.name.startswith(".tmp") for p in saving.glob(".*")) and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)  # a second signal, during the save
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-2000:]
    stopped = json.loads((run / "preempted.json").read_text())["step"]
    assert steps_of(run) == [stopped] and stopped >= 3
    assert [s["step"] for s in samples(run)] == list(range(1, stopped + 1))
    train(run, f"train.max_steps={stopped + 2}")
    assert [s["step"] for s in samples(run)] == list(range(1, stopped + 3))  # none lost, none repeated


def test_incomplete_checkpoints_are_reported_skipped_and_cleaned(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(run, "train.max_steps=4", "train.save_every=2")
    root = run / "checkpoints"
    broken = root / "step-00000006"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes((root / "step-00000004" / "model.safetensors").read_bytes())
    (root / ".tmp-step-00000008").mkdir()
    (root / "latest").write_text("step-00000006\n")  # as if a crash happened between rename and manifest
    proc = train(run, "train.max_steps=5")
    assert "skipping incomplete checkpoint" in proc.stdout and "step-00000006 (no manifest" in proc.stdout
    assert "resumed from" in proc.stdout and "step-00000004 at step 4" in proc.stdout
    assert steps_of(run) == [2, 4, 5]
    assert not broken.exists() and not (root / ".tmp-step-00000008").exists()


def test_a_tampered_checkpoint_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(run, "train.max_steps=2")
    path = run / "checkpoints" / "step-00000002" / "optimizer.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    proc = train(run, "train.max_steps=4", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "optimizer.safetensors does not match the hash" in proc.stderr


def test_a_checkpoint_of_another_model_or_tokenizer_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(run, "train.max_steps=2")
    proc = train(run, "train.max_steps=4", "model.ffn_dim=256", check=False)
    assert proc.returncode == 2 and "model.ffn_dim is 512 there, 256 here" in proc.stderr
    other = tmp_path / "other"
    ckpt = run / "checkpoints" / "step-00000002"
    proc = train(other, "train.max_steps=4", "data.vocab_size=300", f"train.resume={ckpt}", check=False)
    assert proc.returncode == 2 and "another tokenizer" in proc.stderr, proc.stderr[-2000:]
    assert not (other / "checkpoints").exists()  # refused before any work


def test_a_full_disk_stops_the_run_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    disk = tmp_path / "small-disk"
    disk.mkdir()
    # One checkpoint of this model takes about 18 MB (weights and Adam moments in fp32): room for one.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(disk)], check=True)
    try:
        run = disk / "run"
        proc = train(run, "train.max_steps=6", "train.save_every=2", check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert "No space left on device" in proc.stderr and "earlier checkpoints are intact" in proc.stderr
        assert steps_of(run) == [2]
        assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp")]
        kept = run / "checkpoints" / "step-00000002"
        ok = train(tmp_path / "copy", f"train.resume={kept}", "train.max_steps=3")
        assert "at step 2" in ok.stdout  # the previous checkpoint still loads and verifies
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def tpe_ckpt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpe_train.ckpt_cli", *args], capture_output=True, text=True)


def test_the_final_model_is_the_mean_of_the_last_checkpoints_when_asked(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = train(run, "train.max_steps=6", "train.save_every=2", "train.keep_last=3", "eval.average_last=3",
                 "eval.at_end=true")  # fmt: skip
    assert "final model = mean of step-00000002, step-00000004, step-00000006" in proc.stdout
    got = weights(run / "averaged-last3")
    parts = [weights(run / f"checkpoints/step-0000000{s}") for s in (2, 4, 6)]
    for k in got:
        mean = sum(p[k].double() for p in parts) / 3
        assert (got[k] - mean).abs().max() < 1e-7, k
    assert not torch.equal(
        got["encoder.layers.0.ffn.fc_in.weight"], parts[-1]["encoder.layers.0.ffn.fc_in.weight"]
    )
    figures = json.loads((run / "eval.json").read_text())  # the averaged model's figures
    assert figures["selected"]["checkpoints"] == ["step-00000002", "step-00000004", "step-00000006"]
    scored = subprocess.run(
        [sys.executable, "-m", "tpe_train.evaluate", "--checkpoint", str(run / "averaged-last3"), "--json"],
        capture_output=True,
        text=True,
    )
    assert scored.returncode == 0 and json.loads(scored.stdout)["bleu"] == figures["bleu"]
    # the last step's own weights are still exported, as without averaging
    last = weights(run / "checkpoint")
    assert all(torch.equal(last[k], parts[-1][k]) for k in last)


def test_tpe_ckpt_list_average_and_export(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(run, "train.max_steps=6", "train.save_every=2")
    (run / "checkpoints" / ".tmp-step-00000008").mkdir()
    listing = tpe_ckpt("list", str(run))
    assert listing.returncode == 0
    assert re.search(r"step-00000006 +6 complete +world 1 \(dp 1 x tp 1\).*<- latest", listing.stdout)
    assert "INCOMPLETE" in listing.stdout
    avg = tpe_ckpt("average", str(run), "--last", "2", "--out", str(tmp_path / "avg"))
    assert avg.returncode == 0, avg.stderr
    got = weights(tmp_path / "avg")
    a, b = weights(run / "checkpoints/step-00000004"), weights(run / "checkpoints/step-00000006")
    for k in a:
        assert ((got[k] - (a[k].double() + b[k].double()) / 2).abs().max()) < 1e-7
    exp = tpe_ckpt("export", str(run), "--out", str(tmp_path / "exp"))
    assert exp.returncode == 0 and "step-00000006" in exp.stdout
    scored = subprocess.run(
        [sys.executable, "-m", "tpe_train.evaluate", "--checkpoint", str(tmp_path / "exp"), "--json"],
        capture_output=True,
        text=True,
    )
    assert scored.returncode == 0, scored.stderr[-2000:]
    assert 0 <= json.loads(scored.stdout)["bleu"] <= 100
    missing = tpe_ckpt("average", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x"))
    assert missing.returncode == 2 and "no complete checkpoint" in missing.stderr


def test_a_tampered_export_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(run, "train.max_steps=2")
    path = run / "checkpoint" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    proc = subprocess.run(
        [sys.executable, "-m", "tpe_train.evaluate", "--checkpoint", str(run / "checkpoint")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "does not match the hash" in proc.stderr


def test_nothing_unpickles_without_weights_only() -> None:
    for path in (ROOT / "tpe_train").rglob("*.py"):
        text = path.read_text()
        assert "import pickle" not in text, path
        for call in re.findall(r"torch\.load\([^)]*\)", text):
            assert "weights_only=True" in call, (path, call)
    assert os.environ.get("TPE_FAULT_SAVE_DELAY") is None
