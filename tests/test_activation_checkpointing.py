"""train.activation_checkpointing: the gradients of the plain step, bitwise (dropout on), and the
activations a step keeps for its backward, measured with saved-tensor hooks at the base shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import tpe_train.parallel.checkpointing as ac
from tpe_train.model.args import ModelArgs
from tpe_train.model.loss import label_smoothed_loss
from tpe_train.model.transformer import Transformer
from tpe_train.positions import PositionArgs


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """One intra-op thread: these small products gain nothing from two, and lose 100x when the suite's
    other processes hold the cores (OpenMP threads wait for each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def model(
    d: int = 512, heads: int = 8, layers: int = 6, vocab: int = 37_000, kind: str = "sinusoidal"
) -> Transformer:
    """Transformer base by default (d 512, 8 heads, FFN 4d, 6 + 6 layers, dropout 0.1, 37,000 tokens)."""
    torch.manual_seed(0)
    pos = PositionArgs(d_model=d, n_heads=heads, causal=False, max_positions=256)
    args = ModelArgs(
        vocab_size=vocab, d_model=d, n_heads=heads, ffn_dim=4 * d, encoder_layers=layers,
        decoder_layers=layers, dropout=0.1, encoder_position=kind, decoder_position=kind,
        position=pos,
    )  # fmt: skip
    return Transformer(args).train()


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab, (8, 24), generator=gen), torch.randint(3, vocab, (8, 25), generator=gen)


def kept_bytes(net: Transformer, src: torch.Tensor, tgt: torch.Tensor) -> int:
    """The bytes a forward keeps for its backward: every storage autograd saves outside checkpointed
    layers, plus the inputs of checkpointed layers, which their recomputation holds."""
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        kept[storage.data_ptr()] = storage.nbytes()
        return t

    real = ac.checkpoint

    def holding(fn: Any, *args: Any, **kw: Any) -> Any:
        for a in args:
            if isinstance(a, torch.Tensor):
                pack(a)
        return real(fn, *args, **kw)

    with pytest.MonkeyPatch.context() as mp, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mp.setattr(ac, "checkpoint", holding)
        label_smoothed_loss(net(src, tgt[:, :-1]), tgt[:, 1:], 0, 0.1, 1.0)[0]
    return sum(kept.values())


def gradients(net: Transformer, src: torch.Tensor, tgt: torch.Tensor) -> dict[str, torch.Tensor]:
    torch.manual_seed(5)  # the same dropout masks for every mode
    label_smoothed_loss(net(src, tgt[:, :-1]), tgt[:, 1:], 0, 0.1, 1.0)[0].backward()
    return {n: p.grad for n, p in net.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["sinusoidal", "t5", "rope"])
def test_checkpointed_layers_give_the_plain_gradients_bitwise_with_dropout(kind: str) -> None:
    """Bitwise: the recomputation runs the same operations on the same values, dropout included.
    T5 (as ALiBi): the first layer builds the dense mask the others reuse; RoPE: tables built once."""
    src, tgt = batch(100)
    plain = gradients(model(64, 4, 3, 100, kind), src, tgt)
    for mode, count in (("layers", 6), ("every_n", 4)):
        net = model(64, 4, 3, 100, kind)
        assert len(ac.apply_activation_checkpointing(net, mode, every=2)) == count
        grads = gradients(net, src, tgt)
        assert grads.keys() == plain.keys()
        assert all(torch.equal(plain[n], grads[n]) for n in plain), mode  # bitwise


@pytest.mark.slow
def test_at_the_base_shape_a_step_keeps_far_fewer_activations() -> None:
    src, tgt = batch(37_000)
    plain = kept_bytes(model(), src, tgt)
    layers, every = model(), model()
    ac.apply_activation_checkpointing(layers, "layers")
    ac.apply_activation_checkpointing(every, "every_n", every=2)
    kept, kept_every = kept_bytes(layers, src, tgt), kept_bytes(every, src, tgt)
    print(f"kept for the backward: none {plain / 2**20:.1f} MiB, layers {kept / 2**20:.1f} MiB "
          f"({plain / kept:.2f}x lower), every_n=2 {kept_every / 2**20:.1f} MiB")  # fmt: skip
    assert plain / kept >= 2.5 and kept < kept_every < plain


def test_evaluation_and_decoding_run_the_layers_as_they_are() -> None:
    net = model(64, 4, 3, 100)
    ac.apply_activation_checkpointing(net, "layers")
    with pytest.raises(ValueError, match="checkpointed twice"):
        ac.apply_activation_checkpointing(net, "layers")
    assert ac.checkpointed_layers(net, "none") == []
    assert "encoder.layers.0" in ac.checkpointed_layers(net, "every_n", 3)
    assert "encoder.layers.1" not in ac.checkpointed_layers(net, "every_n", 3)
    assert set(net.state_dict()) == set(model(64, 4, 3, 100).state_dict())  # checkpoints unchanged
    net.eval()
    src, tgt = batch(100)
    with torch.no_grad():
        assert torch.equal(net(src, tgt), model(64, 4, 3, 100).eval()(src, tgt))


@pytest.mark.integration
@pytest.mark.parametrize("layout", ["zero", "tp"])
def test_checkpointed_layers_under_zero_1_2_3_and_tensor_parallelism(layout: str, tmp_path: Path) -> None:
    """2 ranks, T5 positions (the mask the first layer builds), every layer checkpointed and the loss in
    chunks of 16 tokens (``train.loss_chunk_tokens``, the output weight read in the backward's
    recomputation): ZeRO 1, 2 and 3 in one launch (tests/support/dist_harness.py ``ac``), AutoTP 2 in
    another, each against one plain process without either on the same global batch for 2 steps. Under
    DDP: the 2-rank run of tests/test_batch_tokens.py."""
    root = Path(__file__).resolve().parents[1]
    if layout == "zero":
        ds = tmp_path / "zero.json"
        ds.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
        launch_file = tmp_path / "zero.yaml"
        text = (root / "configs/accelerate/cpu_zero2.yaml").read_text()
        launch_file.write_text(text.replace("configs/deepspeed/zero2.json", str(ds)))
        stages = ["1", "2", "3"]
    else:
        launch_file, stages = root / "configs/accelerate/cpu_tp2.yaml", []
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(launch_file),
           str(root / "tests/support/dist_harness.py"), "ac", str(out), *stages]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(out.read_text())
    assert (result["dp_size"], result["tp_size"]) == ((2, 1) if layout == "zero" else (1, 2))
    for stage in stages or ["1"]:
        for row in result[stage]:
            assert row["loss"] == pytest.approx(row["ref_loss"], rel=1e-6), (stage, row)
            assert row["param_diff"] < 1e-5, (stage, row)  # as tests/test_distributed.py
