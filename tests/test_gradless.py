"""A trainable parameter that gets no gradient (the ``spare`` of an installed encoding plugin, which its
hooks never use) breaks nothing: the run names it in one warning at its first step, saves (torch's Adam
holds no state for it: its moments are absent from the checkpoint), resumes, and goes on under DeepSpeed
ZeRO 3, 2, 1 and 0 and tensor parallelism (2 ranks each, zero moments there), under ``tpe-ckpt
reshard``, ``average`` and ``export``, and back on one process. Chains of runs, each resuming from the
one before under another layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.plugin_pkg import env_with, install_first_only, install_idle
from tpe_train.ckpt.shards import read_index, read_tensor

pytestmark = pytest.mark.integration  # every test here starts the project's commands

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--preset", "demo", "model.position.kind=idle",
    "data.synthetic.train_size=200", "data.synthetic.valid_size=8", "data.synthetic.test_size=10",
    "data.synthetic.long_size=4", "data.synthetic.probe_size=4", "data.synthetic.max_words=10",
    "data.synthetic.long_max_words=12", "data.vocab_size=150", "data.max_tokens=512",
    "model.d_model=16", "model.ffn_dim=32", "model.n_heads=2", "model.encoder_layers=1",
    "model.decoder_layers=1", "train.valid_bleu_size=0", "train.progress=false", "eval.at_end=false",
]  # fmt: skip
SPARE = ["encoder.positions.0.spare", "decoder.positions.0.spare"]
WARNING = "no gradient at step {step} for the trainable parameter(s) " + ", ".join(SPARE) + ":"


def launch_file(tmp: Path, stage: int) -> str:
    """The 2-rank ZeRO-2 launch file with the DeepSpeed config of ``stage``."""
    text = (ROOT / "configs/accelerate/cpu_zero2.yaml").read_text()
    path = tmp / f"cpu_zero{stage}.yaml"
    path.write_text(text.replace("configs/deepspeed/zero2.json", f"configs/deepspeed/zero{stage}.json"))
    return str(path)


def run(args: list[str], env: dict[str, str]) -> str:
    """A command's output (stdout and stderr); it must succeed."""
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return proc.stdout + proc.stderr


def train(env: dict[str, str], launch: str | None, run_dir: Path, *overrides: str) -> str:
    args = ["-m", "tpe_train.train", *TINY, f"train.run_dir={run_dir}", *overrides]
    if launch is None:
        return run([sys.executable, *args, "train.threads=1"], env)
    return run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", launch, *args], env)


def ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:08d}"


def tensors(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors of the encoding (weights and moments), consolidated from its shards."""
    index = read_index(path)
    return {n: read_tensor(path, index, n) for n in index["tensors"] if ".positions.0." in n}


def trainer(path: Path) -> dict:
    return json.loads((path / "trainer.json").read_text())


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {**env_with(install_idle(tmp_path_factory.mktemp("plugin"))), "DS_ACCELERATOR": "cpu"}


@pytest.fixture(scope="module")
def plain(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """One process: steps 1-2 (a save at each), then resumed for step 3."""
    run_dir = tmp_path_factory.mktemp("plain") / "run"
    first = train(env, None, run_dir, "train.max_steps=2", "train.save_every=1")
    resumed = train(env, None, run_dir, "train.max_steps=3")
    return run_dir, first, resumed


def test_one_process_warns_once_and_saves_without_state_for_the_parameter(
    plain: tuple[Path, str, str],
) -> None:
    run_dir, first, resumed = plain
    assert first.count("no gradient at step") == 1 and WARNING.format(step=1) in first
    assert "checkpoints, reshards, averages and exports save them as they are" in first
    for step in (1, 2, 3):
        saved = tensors(ckpt(run_dir, step))
        assert all(torch.equal(saved[n], torch.zeros(3)) for n in SPARE)  # never moved
        assert not any(n.endswith("spare") and "/" in n for n in saved)  # no state: no moments
        assert "exp_avg/encoder.positions.0.gain" in saved
    # resumed: warned again at its own first step, the state still absent, Adam's count going on
    assert resumed.count("no gradient at step") == 1 and WARNING.format(step=3) in resumed
    assert "resumed from" in resumed and trainer(ckpt(run_dir, 3))["adam_steps"] == 3
    assert not torch.equal(tensors(ckpt(run_dir, 3))["encoder.positions.0.gain"], torch.ones(1))


Chain = dict[str, tuple[Path, str, Path]]  # name -> run directory, output, checkpoint it started from


@pytest.fixture(scope="module")
def chain(
    plain: tuple[Path, str, str], env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Chain:
    """From the one-process checkpoint of step 3 (no moments for the parameter): a step under each ZeRO
    stage in turn, 3 to 0 (2 ranks), then one on one process; a reshard of that checkpoint to tensor
    parallelism 2, and a step there. Average and export."""
    tmp, out = tmp_path_factory.mktemp("chain"), {}
    start = first = ckpt(plain[0], 3)
    for step, stage in enumerate((3, 2, 1, 0), start=4):
        run_dir = tmp / f"zero{stage}"
        output = train(
            env, launch_file(tmp, stage), run_dir, f"train.resume={start}", f"train.max_steps={step}"
        )
        out[f"zero{stage}"], start = (run_dir, output, start), ckpt(run_dir, step)
    output = train(env, None, tmp / "one", f"train.resume={start}", "train.max_steps=8")
    out["one"] = tmp / "one", output, start
    tp2, cli = str(ROOT / "configs/accelerate/cpu_tp2.yaml"), [sys.executable, "-m", "tpe_train.ckpt.cli"]
    output = run([*cli, "reshard", str(first), "--config_file", tp2, "--out", str(tmp / "resharded")], env)
    out["reshard"], start = (tmp / "resharded", output, first), ckpt(tmp / "resharded", 3)
    output = train(env, tp2, tmp / "tp2", f"train.resume={start}", "train.max_steps=4")
    out["tp2"] = tmp / "tp2", output, start
    output = run([*cli, "average", str(plain[0]), "--last", "3", "--out", str(tmp / "averaged")], env)
    out["average"] = tmp / "averaged", output, plain[0]
    output = run([*cli, "export", str(tmp / "tp2"), "--out", str(tmp / "exported")], env)
    out["export"] = tmp / "exported", output, tmp / "tp2"
    return out


LAYOUTS = {  # the step each saved at, and its layout
    "zero3": (4, {"world_size": 2, "tp_size": 1, "dp_size": 2, "zero_stage": 3}),
    "zero2": (5, {"world_size": 2, "tp_size": 1, "dp_size": 2, "zero_stage": 2}),
    "zero1": (6, {"world_size": 2, "tp_size": 1, "dp_size": 2, "zero_stage": 1}),
    "zero0": (7, {"world_size": 2, "tp_size": 1, "dp_size": 2, "zero_stage": 0}),
    "one": (8, {"world_size": 1, "tp_size": 1, "dp_size": 1, "zero_stage": None}),
    "reshard": (3, {"world_size": 2, "tp_size": 2, "dp_size": 1, "zero_stage": 1}),
    "tp2": (4, {"world_size": 2, "tp_size": 2, "dp_size": 1, "zero_stage": 1}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_resumes_warns_once_and_saves_zero_moments(chain: Chain, name: str) -> None:
    (run_dir, output, start), (step, layout) = chain[name], LAYOUTS[name]
    path = ckpt(run_dir, step)
    assert json.loads((path / "manifest.json").read_text())["layout"] == layout
    assert trainer(path)["adam_steps"] == step  # the most of any parameter's count
    saved, before = tensors(path), tensors(start)
    for n in SPARE:
        assert torch.equal(saved[n], torch.zeros(3))
        # DeepSpeed holds zero moments for it (loaded as zeros where the checkpoint has none, as in
        # "zero3" and "reshard"); so does torch's Adam once they are loaded ("one")
        assert torch.equal(saved[f"exp_avg/{n}"], torch.zeros(3))
        assert torch.equal(saved[f"exp_avg_sq/{n}"], torch.zeros(3))
    gain = "encoder.positions.0.gain"
    if name == "reshard":  # no step taken: the same numbers, and nothing to warn about
        assert "no gradient" not in output
        assert all(torch.equal(saved[n], before[n]) for n in before)
    else:
        assert output.count("no gradient at step") == 1 and WARNING.format(step=step) in output
        assert "resumed from" in output and not torch.equal(saved[gain], before[gain])  # training went on


def test_average_and_export_write_the_parameter_as_it_is(chain: Chain) -> None:
    for name in ("average", "export"):
        weights = load_file(str(chain[name][0] / "model.safetensors"))
        assert all(torch.equal(weights[n], torch.zeros(3)) for n in SPARE), name


def test_plain_ddp_trains_a_model_with_a_parameter_that_gets_no_gradient(
    env: dict[str, str], tmp_path: Path
) -> None:
    """torch DDP (configs/accelerate/cpu_ddp.yaml, 2 ranks) expects a gradient for every parameter
    unless it searches for the missing ones: it searches at the first step, keeps searching when a
    parameter got none (without the search the second step stops: "Expected to have finished reduction"),
    warns once, saves the parameter as it is and resumes."""
    run_dir = tmp_path / "ddp"
    ddp = str(ROOT / "configs/accelerate/cpu_ddp.yaml")
    first = train(env, ddp, run_dir, "train.max_steps=3", "train.save_every=1")
    resumed = train(env, ddp, run_dir, "train.max_steps=5", "train.save_every=1")
    assert first.count("no gradient at step") == 1 and WARNING.format(step=1) in first
    assert resumed.count("no gradient at step") == 1 and WARNING.format(step=4) in resumed
    saved, start = tensors(ckpt(run_dir, 5)), tensors(ckpt(run_dir, 1))
    assert json.loads((ckpt(run_dir, 5) / "manifest.json").read_text())["layout"]["dp_size"] == 2
    for n in SPARE:
        assert torch.equal(saved[n], torch.zeros(3))
    gain = "encoder.positions.0.gain"
    assert "resumed from" in resumed and not torch.equal(saved[gain], start[gain])


def test_plain_ddp_names_the_setting_for_a_parameter_unused_after_the_first_step(
    tmp_path: Path,
) -> None:
    """A parameter that gets a gradient in the first step and none later (the encoding ``once``): by
    default DDP stops searching after the first step and torch stops at the third with its own message;
    the run says instead what happened and which setting trains it, keeping the checkpoint of step 1.
    With ``parallel.find_unused=always`` the same run trains and saves."""
    env = {**env_with(install_first_only(tmp_path / "plugin")), "DS_ACCELERATOR": "cpu"}
    ddp = str(ROOT / "configs/accelerate/cpu_ddp.yaml")
    base = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", ddp, "-m", "tpe_train.train"]
    args = [*TINY, "model.position.kind=once", "train.max_steps=4", "train.save_every=1"]
    stopped = subprocess.run(
        [*base, *args, f"train.run_dir={tmp_path / 'first'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode != 0, output[-3000:]
    assert "a trainable parameter got no gradient in the last step" in output
    assert "Set parallel.find_unused=always" in output
    assert ckpt(tmp_path / "first", 1).is_dir() and not ckpt(tmp_path / "first", 4).exists()
    trained = train(env, ddp, tmp_path / "always", "model.position.kind=once", "train.max_steps=4",
                    "parallel.find_unused=always")  # fmt: skip
    assert "no gradient" not in trained
    saved = tensors(ckpt(tmp_path / "always", 4))
    assert not torch.equal(saved["encoder.positions.0.extra"], torch.zeros(1))  # its one update
