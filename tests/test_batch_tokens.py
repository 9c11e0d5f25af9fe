"""train.batch_tokens: the global batch resolved for any number of ranks, the global stream order,
data.max_tokens=auto's search, and tpe-launch --dry-run showing the same resolution."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from launcher.cli import main as launch
from launcher.plan import LaunchFile
from tpe_train.ckpt.rundir import RunDir
from tpe_train.config import ConfigError, load_config
from tpe_train.data.batching import BatchIterator, BatchState, length_arrays
from tpe_train.parallel.batch import GRAIN, largest_fitting, micro_tokens, resolve
from tpe_train.parallel.context import ParallelContext
from tpe_train.train.batch_size import auto_note, probe_max_tokens, record, recorded_max_tokens


def lengths(n: int = 600, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    src = rng.integers(3, 40, n)
    return src, np.maximum(2, src + rng.integers(-3, 4, n))


def test_the_accumulation_is_the_smallest_that_reaches_the_global_batch() -> None:
    for dp, acc in ((1, 8), (2, 4), (4, 2), (8, 1), (16, 1)):
        plan = resolve(25_000, 7_000, 3_125.0, dp)
        assert plan.accumulate == acc and plan.micro_per_step == max(8, dp)
    assert resolve(25_000, 7_000, 3_125.0, 16).warning() is not None  # 50,000: +100%
    assert resolve(25_000, 7_000, 3_125.0, 8).warning() is None
    odd = resolve(10_000, 4_096, 3_000.0, 1)  # 4 x 3,000 = 12,000: +20%
    assert odd.accumulate == 4 and "+20%" in (odd.warning() or "")
    assert resolve(0, 4_096, 3_000.0, 2, accumulate=3).accumulate == 3  # 0: by hand, as before
    src, tgt = lengths()
    n = len(BatchIterator(src, tgt, 512, seed=1).batches)
    assert micro_tokens(src, tgt, 512, seed=1) == pytest.approx(tgt.sum() / n)  # the epoch's exact mean


def test_batch_tokens_with_a_hand_set_accumulation_is_an_error_and_auto_round_trips() -> None:
    with pytest.raises(ConfigError, match=r"train.accumulate=4 and train.batch_tokens=25000"):
        load_config("demo", ["train.batch_tokens=25000", "train.accumulate=4"])
    cfg = load_config("demo", ["data.max_tokens=auto", "train.batch_tokens=2000"])
    assert cfg.data.max_tokens == 0 and "max_tokens: auto" in cfg.to_yaml()
    with pytest.raises(ConfigError, match=r"data.max_tokens=8"):
        load_config("demo", ["data.max_tokens=8"])
    with pytest.raises(ConfigError, match=r"auto probes the longest pairs of a prepared corpus"):
        load_config("demo", ["data.max_tokens=auto", "data.streaming=true"])
    for name in ("wmt14_en_de_base", "wmt14_en_de_big", "wmt14_en_fr_big"):
        assert load_config(name).train.batch_tokens == 25_000


def test_one_two_and_four_ranks_take_the_same_global_batches_step_by_step() -> None:
    """With the product accumulate x dp fixed (8), every step of 1, 2 or 4 ranks holds the same 8
    micro-batches of one global stream; resuming the position on another number of ranks continues it."""
    src, tgt = lengths()
    steps: dict[int, list[list[tuple[int, ...]]]] = {}
    for dp in (1, 2, 4):
        acc = resolve(8 * 100, 512, 100.0, dp).accumulate
        its = [iter(BatchIterator(src, tgt, 512, seed=1, dp_rank=r, dp_size=dp)) for r in range(dp)]
        steps[dp] = [
            sorted(tuple(next(it).tolist()) for _ in range(acc) for it in its) for _ in range(20)
        ]  # 20 steps: more than an epoch (the corpus makes about 50 batches)
    assert steps[1] == steps[2] == steps[4]
    first = BatchIterator(src, tgt, 512, seed=1, dp_rank=0, dp_size=2)
    it = iter(first)
    for _ in range(4 * 7):  # 7 steps of 2 ranks x 4
        next(it)
    state = BatchState(first.state.epoch, first.state.taken)
    resumed = [
        iter(BatchIterator(src, tgt, 512, seed=1, dp_rank=r, dp_size=4, state=state)) for r in range(4)
    ]
    assert sorted(tuple(next(i).tolist()) for _ in range(2) for i in resumed) == steps[1][7]


def test_auto_finds_the_largest_multiple_of_64_that_fits() -> None:
    for edge in (64, 100, 4096, 5000, 70_001, 1 << 20):
        calls: list[int] = []

        def fits(m: int, edge: int = edge, log: list[int] = calls) -> bool:
            log.append(m)
            return m <= edge

        assert largest_fitting(fits) == edge // GRAIN * GRAIN
        assert all(m % GRAIN == 0 for m in calls) and len(calls) < 30
    with pytest.raises(ValueError, match="not even"):
        largest_fitting(lambda m: False)


def test_auto_on_a_cpu_is_an_error_and_a_probe_is_recorded_for_the_resume(tmp_path: Path) -> None:
    cfg = load_config("demo", ["data.max_tokens=auto"])
    with pytest.raises(ConfigError, match=r"data.max_tokens=auto probes a GPU"):
        probe_max_tokens(cfg, None, ParallelContext.fake())  # type: ignore[arg-type]
    run = RunDir(tmp_path)
    assert recorded_max_tokens(run) is None
    plan = resolve(2000, 4032, 1000.0, 1)
    record(run, plan, auto=True)
    assert recorded_max_tokens(run) == 4032 and json.loads(run.batch.read_text())["accumulate"] == 2
    assert "auto: 4,032 padded tokens" in (auto_note(cfg, plan) or "")


def test_dry_run_shows_the_resolution_and_finds_a_launch_files_deepspeed_json_from_anywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    own = tmp_path / "launch"
    own.mkdir()
    (own / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    text = (Path(__file__).parents[1] / "configs/accelerate/gpu_zero2.yaml").read_text()
    (own / "mine.yaml").write_text(text.replace("configs/deepspeed/zero2.json", "ds.json"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert LaunchFile.load(str(own / "mine.yaml")).deepspeed_file == own / "ds.json"
    assert LaunchFile.load("gpu_zero2").deepspeed_file is not None  # the repository's own, from anywhere
    for gpus, acc in ((1, 8), (8, 1)):
        args = ["run", "--dry-run", "--preset", "wmt14_en_de_base", "--gpus-per-node", str(gpus)]
        assert launch([*args, "--layout", str(own / "mine.yaml")]) == 0
        out = capsys.readouterr().out
        assert f"= {gpus} data-parallel x {acc} accumulated" in out, out
        assert f"--deepspeed_config_file {own / 'ds.json'}" in out
    args = ["submit", "--dry-run", "--preset", "wmt14_en_de_base", "--nodes", "4", "--gpus-per-node", "8"]
    assert launch([*args, "--", "data.max_tokens=1750"]) == 0
    out = capsys.readouterr().out
    assert "# batch: 25,200 target tokens per step (25,000 asked) = 32 data-parallel x 1 accumulated" in out
    assert launch(args) == 0
    assert "+303% off train.batch_tokens=25,000" in capsys.readouterr().out  # the preset's micro-batch


def _run_args(run_dir: Path, extra: list[str]) -> list[str]:
    return [
        "model.d_model=32", "model.n_heads=4", "model.ffn_dim=64", "model.encoder_layers=2",
        "model.decoder_layers=2", "model.dropout=0.0",  # dropout draws per rank: off, to compare losses
        "data.synthetic.train_size=1500", "data.synthetic.valid_size=50", "data.synthetic.test_size=20",
        "data.synthetic.probe_size=10", "data.synthetic.long_size=10", "data.max_tokens=256",
        "train.max_steps=20", "train.log_every=1", "train.save_every=10", "train.valid_every=1000",
        "train.valid_bleu_size=0", "train.progress=false", "train.log_samples=true", "train.threads=1",
        "train.warmup_steps=10", "train.lr=3e-3", "eval.at_end=false", f"train.run_dir={run_dir}", *extra,
    ]  # fmt: skip


def _steps(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    return {
        t: {e.step: e.value for e in acc.Scalars(t)}
        for t in ("train/loss", "train/lr", "train/target_tokens")
    }


def _pairs(run_dir: Path) -> dict[int, list[int]]:
    """The pair ids each step trained on, over all data-parallel ranks (train.log_samples)."""
    out: dict[int, list[int]] = {}
    for path in sorted((run_dir / "samples").glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            out.setdefault(row["step"], []).extend(row["ids"])
    return {step: sorted(ids) for step, ids in out.items()}


@pytest.mark.integration
def test_one_two_and_four_ranks_train_the_same_trajectory_and_resume_across_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same train.batch_tokens and seed: 1 process (here), 2 ranks (ZeRO-2, checkpointed layers,
    launched by tpe-launch from another directory) and 4 ranks (DDP), each from scratch for 20 steps,
    and 4 ranks (DDP, every other layer checkpointed, the loss in chunks of 64 target tokens) and 1
    process resumed from the 2-rank run's step
    10, train the same target tokens and pairs per step, and their losses agree within 2e-5 (relative;
    fp32 sums in another order: ranks all-reduce their partial gradients, one process accumulates
    them). Dropout is off: it draws one stream per rank."""
    import os
    import subprocess
    import sys

    from tpe_train.data.prepare import prepare
    from tpe_train.train.loop import run

    root = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("TPE_DATA_CACHE", str(tmp_path / "data"))
    cfg = load_config("demo", _run_args(tmp_path / "x", []))
    data = prepare(cfg.data)
    micro = micro_tokens(*length_arrays(data.train), 256, cfg.train.seed)
    tokens = f"train.batch_tokens={int(8 * micro)}"  # 8 micro-batches a step: 8 x 1, 4 x 2, 2 x 4
    one, two, four, back, fresh4 = (tmp_path / n for n in ("one", "two", "four", "back", "fresh4"))
    run(load_config("demo", _run_args(one, [tokens])))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    resume = f"train.resume={two / 'checkpoints' / 'step-00000010'}"
    # 2 ranks: ZeRO-2 with checkpointed layers, through tpe-launch from another directory (the launch
    # file names its DeepSpeed JSON relative to the repository); 4 ranks: DDP, resumed from its step 10
    every_n = ("train.activation_checkpointing=every_n", "train.loss_chunk_tokens=64")
    zero2 = ["run", "--layout", "cpu_zero2", "--procs-per-node", "2", "--preset", "demo", "--"]
    ddp = ["--config_file", str(root / "configs/accelerate/cpu_ddp.yaml"), "--num_processes", "4"]
    launches = (
        (2, [sys.executable, "-m", "launcher.cli", *zero2,
             *_run_args(two, [tokens, "train.activation_checkpointing=layers"])]),
        (4, [sys.executable, "-m", "accelerate.commands.launch", *ddp, "-m", "tpe_train.train",
             "--preset", "demo", *_run_args(four, [tokens, resume, *every_n])]),
        (4, [sys.executable, "-m", "accelerate.commands.launch", *ddp, "-m", "tpe_train.train",
             "--preset", "demo", *_run_args(fresh4, [tokens])]),
    )  # fmt: skip
    for procs, cmd in launches:
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        assert f"= {procs} data-parallel x {8 // procs} accumulated" in proc.stdout
    assert json.loads((two / "deepspeed.json").read_text())["zero_optimization"]["stage"] == 2
    run(load_config("demo", _run_args(back, [tokens, resume])))
    ref, ref_pairs = _steps(one), _pairs(one)
    assert sorted(ref["train/loss"]) == list(range(1, 21))
    for run_dir, first in ((two, 1), (fresh4, 1), (four, 11), (back, 11)):
        got, pairs = _steps(run_dir), _pairs(run_dir)
        for step in range(first, 21):
            assert got["train/target_tokens"][step] == ref["train/target_tokens"][step]
            assert got["train/lr"][step] == ref["train/lr"][step]
            assert pairs[step] == ref_pairs[step], (run_dir.name, step)
        loss, want = got["train/loss"], ref["train/loss"]
        worst = max(abs(loss[s] / want[s] - 1) for s in range(first, 21))
        print(f"{run_dir.name}: steps {first}-20, largest relative loss difference {worst:.1e}")
        assert worst <= 2e-5, (run_dir.name, loss, want)
