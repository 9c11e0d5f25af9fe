"""Training checkpoints in one process: saving and pruning, exact resume, preemption signals, incomplete
and tampered checkpoints, foreign configs and tokenizers, a full disk, and tpe-ckpt."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tpe_train.ckpt.cli import main as ckpt_main
from tpe_train.ckpt.shards import read_index, read_tensor
from tpe_train.ckpt.store import entries, sha256

pytestmark = pytest.mark.integration  # every test here starts the project's commands

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


def weights(path: Path, moments: bool = False) -> dict:
    """A checkpoint's weights (or Adam moments), consolidated from its shards."""
    index = read_index(path)
    return {n: read_tensor(path, index, n) for n in index["tensors"] if ("/" in n) == moments}


def exported(path: Path) -> dict:
    return load_file(str(path / "model.safetensors"))


def test_saving_keeps_the_last_k_and_every_mth_with_a_manifest(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(run, "train.max_steps=10", "train.save_every=2", "train.keep_last=2", "train.keep_every=4")
    assert steps_of(run) == [4, 8, 10]  # the last two, and every multiple of 4
    root = run / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-00000010"
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]
    manifest = json.loads((root / "step-00000010" / "manifest.json").read_text())
    expected = {
        "model-00000.safetensors",
        "optimizer-00000.safetensors",
        "index.json",
        "trainer.json",
        "rank-00000.json",
        "config.yaml",
        "tokenizer.json",
    }
    assert expected <= set(manifest["files"])
    for name, info in manifest["files"].items():
        assert sha256(root / "step-00000010" / name) == info["sha256"], name
    trainer = json.loads((root / "step-00000010" / "trainer.json").read_text())
    assert trainer["step"] == 10 and trainer["adam_steps"] == 10 and trainer["tokens"] > 0
    assert trainer["layout"] == {"world_size": 1, "tp_size": 1, "dp_size": 1, "zero_stage": None}


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 steps without a break, saved at the end only: the reference of the exact-resume tests."""
    run = tmp_path_factory.mktemp("whole") / "run"
    train(run, "train.max_steps=12", "train.save_every=0")
    return run


def test_n_steps_resume_n_steps_equals_2n_steps_bitwise(whole: Path, tmp_path: Path) -> None:
    halves = tmp_path / "halves"
    train(halves, "train.max_steps=6", "train.save_every=0")
    proc = train(halves, "train.max_steps=12", "train.save_every=0")
    assert "resumed from" in proc.stdout and "at step 6" in proc.stdout
    a, b = weights(whole / "checkpoints/step-00000012"), weights(halves / "checkpoints/step-00000012")
    assert all((a[k] == b[k]).all() for k in a)  # bitwise
    a6 = weights(halves / "checkpoints/step-00000006")
    assert any((a[k] != a6[k]).any() for k in a)  # and the second half did train
    opt_a = weights(whole / "checkpoints/step-00000012", moments=True)
    opt_b = weights(halves / "checkpoints/step-00000012", moments=True)
    assert len(opt_a) == 2 * len(a) and all((opt_a[k] == opt_b[k]).all() for k in opt_a)
    assert samples(whole) == samples(halves)  # the same batches, in the same order


def test_fp16_resume_keeps_the_loss_scale_and_is_bitwise(tmp_path: Path) -> None:
    """train.fp16 without DeepSpeed: a first scale that overflows (skipped updates, the scale halved)
    and a window of 2 (the scale doubled): 4 + 4 steps give 8 steps' weights, Adam state and loss
    scale bitwise, so the scale and its growth count came back from the checkpoint."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    fp16 = ["train.fp16=true", "train.loss_scale_power=17", "train.loss_scale_window=2", "train.save_every=0"]
    fp16 += ["data.max_tokens=256", "train.log_every=1"]  # fp16 products are slow on a CPU
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    train(whole, *fp16, "train.max_steps=8")
    train(halves, *fp16, "train.max_steps=4")
    train(halves, *fp16, "train.max_steps=8")
    step8 = [run / "checkpoints/step-00000008" for run in (whole, halves)]
    for moments in (False, True):
        a, b = (weights(p, moments) for p in step8)
        assert a and all(torch.equal(a[k], b[k]) for k in a)
    trainer = [json.loads((p / "trainer.json").read_text()) for p in step8]
    assert trainer[0]["loss_scaler"] == trainer[1]["loss_scaler"]
    events = EventAccumulator(str(whole / "tb"))
    events.Reload()
    scales = [e.value for e in events.Scalars("train/loss_scale")]
    assert len(scales) == 8 and scales[0] == 2.0**16  # the first step overflowed
    assert any(later > earlier for earlier, later in itertools.pairwise(scales)), scales  # grown
    assert trainer[0]["adam_steps"] < 8  # the overflows skipped updates


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


def start(run: Path, *overrides: str, **env: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tpe_train.train", *SMALL, f"train.run_dir={run}", *overrides]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env}
    )


def wait_for(proc: subprocess.Popen, condition: Callable[[], bool]) -> None:
    deadline = time.time() + 300
    while not condition():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.02)


def lines(run: Path) -> int:
    log = run / "samples" / "rank-00000.jsonl"
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_sigterm_alone_waits_for_the_background_save_then_saves_and_exits_75(tmp_path: Path) -> None:
    """With train.async_save, the save of step 2 is still being written (held 3 s) when SIGTERM comes:
    the trainer finishes its step, waits for that write, saves its own step and exits 75."""
    run = tmp_path / "run"
    proc = start(run, "train.max_steps=400", "train.save_every=2", "train.async_save=true",
                 TPE_FAULT_SAVE_DELAY="3@2")  # fmt: skip
    wait_for(proc, lambda: (run / "checkpoints" / ".tmp-step-00000002").exists())
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-2000:]
    stopped = json.loads((run / "preempted.json").read_text())["step"]
    assert stopped >= 3 and steps_of(run) == [2, stopped]
    assert [s["step"] for s in samples(run)] == list(range(1, stopped + 1))


def test_async_save_trains_on_meanwhile_and_a_crash_mid_write_keeps_the_previous_checkpoint(
    whole: Path, tmp_path: Path
) -> None:
    """Training goes on while the step-8 checkpoint is written in the background; SIGKILL before it is
    complete leaves step 4 as the resume point, and the resumed run ends bitwise where the uninterrupted
    run ends, having trained on the same batches."""
    run = tmp_path / "run"
    proc = start(run, "train.max_steps=12", "train.save_every=4", "train.async_save=true",
                 TPE_FAULT_SAVE_DELAY="300@8")  # fmt: skip
    wait_for(proc, lambda: (run / "checkpoints" / ".tmp-step-00000008").exists() and lines(run) >= 9)
    proc.kill()
    proc.communicate()
    assert steps_of(run) == [4]
    out = train(run, "train.max_steps=12", "train.save_every=4", "train.async_save=true").stdout
    assert "step-00000004 at step 4" in out
    assert steps_of(run) == [4, 8, 12]
    a, b = weights(whole / "checkpoints/step-00000012"), weights(run / "checkpoints/step-00000012")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    last = {r["step"]: r["ids"] for r in samples(run)}  # the steps after 4 were trained twice: the last wins
    assert last == {r["step"]: r["ids"] for r in samples(whole)}


def test_incomplete_checkpoints_are_reported_skipped_and_cleaned(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(run, "train.max_steps=4", "train.save_every=2")
    root = run / "checkpoints"
    broken = root / "step-00000006"
    broken.mkdir()
    (broken / "model-00000.safetensors").write_bytes(
        (root / "step-00000004" / "model-00000.safetensors").read_bytes()
    )
    (root / ".tmp-step-00000008").mkdir()
    (root / "latest").write_text("step-00000006\n")  # as if a crash happened between rename and manifest
    proc = train(run, "train.max_steps=5")
    assert "skipping incomplete checkpoint" in proc.stdout and "step-00000006 (no manifest" in proc.stdout
    assert "resumed from" in proc.stdout and "step-00000004 at step 4" in proc.stdout
    assert steps_of(run) == [2, 4, 5]
    # the protocol's own temporary is removed; a step directory it cannot read is not its own: kept
    assert broken.is_dir() and not (root / ".tmp-step-00000008").exists()
    assert f"not pruning {broken}: no manifest" in proc.stderr


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_tampered_checkpoint_auto_falls_back_latest_stops(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(run, "train.max_steps=4", "train.save_every=2")
    root = run / "checkpoints"
    flip_last_byte(root / "step-00000004" / "optimizer-00000.safetensors")  # same size: the hash tells
    strict = train(run, "train.max_steps=6", "train.resume=latest", check=False)
    assert strict.returncode == 2 and "Traceback" not in strict.stderr
    assert "step-00000004/optimizer-00000.safetensors does not match the hash" in strict.stderr
    flip_last_byte(root / "step-00000002" / "model-00000.safetensors")
    none = train(run, "train.max_steps=6", check=False)  # auto, and no checkpoint verifies
    assert none.returncode == 2 and "no checkpoint in" in none.stderr and "Traceback" not in none.stderr
    assert steps_of(run) == [2, 4] and not list(root.glob("*.corrupt*"))  # refused: nothing renamed
    flip_last_byte(root / "step-00000002" / "model-00000.safetensors")  # step 2 is sound again
    auto = train(run, "train.max_steps=6", "train.save_every=2")
    assert "warning: skipping checkpoint step-00000004: " in auto.stderr
    assert "optimizer-00000.safetensors does not match the hash" in auto.stderr
    assert f"Moved aside to {root / 'step-00000004.corrupt'}" in auto.stderr
    assert "resumed from" in auto.stdout and "step-00000002 at step 2" in auto.stdout
    assert steps_of(run) == [2, 4, 6] and (root / "step-00000004.corrupt" / "manifest.json").is_file()
    assert [s["step"] for s in samples(run)] == [1, 2, 3, 4, 3, 4, 5, 6]  # 3 and 4 again, from step 2


def test_train_resume_is_a_mode_or_a_path() -> None:
    from tpe_train.config import ConfigError, load_config

    for bad in ("Auto", "NEVER", "strict", "''"):
        try:
            load_config("demo", [f"train.resume={bad}"])
        except ConfigError as err:
            assert "train.resume=" in str(err) and "latest (the newest checkpoint, strict)" in str(err)
        else:
            raise AssertionError(f"train.resume={bad!r} was accepted")
    assert load_config("demo", ["train.resume=latest"]).train.resume == "latest"


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
    return subprocess.run([sys.executable, "-m", "tpe_train.ckpt.cli", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """6 steps saved every 2 and the mean of the last 3 as the final model, evaluated at the end: the
    run directory and the run's output. The tpe-ckpt test reads a copy of it."""
    run = tmp_path_factory.mktemp("six") / "run"
    proc = train(run, "train.max_steps=6", "train.save_every=2", "train.keep_last=3", "eval.average_last=3",
                 "eval.at_end=true")  # fmt: skip
    return run, proc.stdout


def test_the_final_model_is_the_mean_of_the_last_checkpoints_when_asked(six_steps: tuple[Path, str]) -> None:
    run, stdout = six_steps
    assert "final model = mean of step-00000002, step-00000004, step-00000006" in stdout
    got = exported(run / "averaged-last3")
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
        [
            sys.executable,
            "-m",
            "tpe_train.evaluation",
            "--checkpoint",
            str(run / "averaged-last3"),
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert scored.returncode == 0 and json.loads(scored.stdout)["bleu"] == figures["bleu"]
    # the last step's own weights are still exported, as without averaging
    last = exported(run / "checkpoint")
    assert all(torch.equal(last[k], parts[-1][k]) for k in last)


def test_tpe_ckpt_list_average_and_export(
    six_steps: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    shutil.copytree(six_steps[0], run)  # checkpoints at steps 2, 4 and 6
    (run / "checkpoints" / ".tmp-step-00000008").mkdir()
    listing = tpe_ckpt("list", str(run))
    assert listing.returncode == 0
    assert re.search(r"step-00000006 +6 complete +world 1 \(dp 1 x tp 1\).*<- latest", listing.stdout)
    assert "INCOMPLETE" in listing.stdout
    avg = tpe_ckpt("average", str(run), "--last", "2", "--out", str(tmp_path / "avg"))
    assert avg.returncode == 0, avg.stderr
    got = exported(tmp_path / "avg")
    a, b = weights(run / "checkpoints/step-00000004"), weights(run / "checkpoints/step-00000006")
    for k in a:
        assert ((got[k] - (a[k].double() + b[k].double()) / 2).abs().max()) < 1e-7
    exp = tpe_ckpt("export", str(run), "--out", str(tmp_path / "exp"))
    assert exp.returncode == 0 and "step-00000006" in exp.stdout
    scored = subprocess.run(
        [
            sys.executable,
            "-m",
            "tpe_train.evaluation",
            "--checkpoint",
            str(tmp_path / "exp"),
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert scored.returncode == 0, scored.stderr[-2000:]
    assert 0 <= json.loads(scored.stdout)["bleu"] <= 100
    # a run directory without checkpoints: exit status 2 and the reason (in this process: one start less)
    assert ckpt_main(["average", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


def test_a_tampered_export_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(run, "train.max_steps=2")
    path = run / "checkpoint" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    proc = subprocess.run(
        [sys.executable, "-m", "tpe_train.evaluation", "--checkpoint", str(run / "checkpoint")],
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
