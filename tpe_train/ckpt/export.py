"""Exports: safetensors weights + resolved config + tokenizer + hashes, what ``tpe-eval`` reads.

An export is consolidated offline from a training checkpoint's shards (or the mean of several), one
tensor at a time, written under a temporary name and renamed into place only when complete, so an
interrupted export never leaves a half-written directory where a reader looks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file
from tokenizers import Tokenizer

from tpe_train.ckpt.rundir import CONFIG, TOKENIZER, RunDir
from tpe_train.ckpt.shards import read_index, read_tensor, write_safetensors
from tpe_train.ckpt.store import TRAINER, CheckpointError, entries, sha256, verify, written_directory
from tpe_train.config import Config, ConfigError, validate
from tpe_train.data.batching import model_args
from tpe_train.data.tokenizer import load_tokenizer, vocab_hash
from tpe_train.model.build import build_model
from tpe_train.model.transformer import Transformer

#: An export's files besides ``CONFIG`` and ``TOKENIZER``: the weights, and hashes and step.
WEIGHTS, META = "model.safetensors", "meta.json"


def write_export(
    directory: Path,
    tensors: Iterator[tuple[str, torch.Tensor]],
    shapes: dict[str, tuple[int, ...]],
    cfg: Config,
    tok: Tokenizer,
    step: int,
) -> Path:
    """Write weights (``tensors``, one at a time, in the order of ``shapes``), config, tokenizer and
    metadata to ``directory`` atomically."""
    directory = Path(directory)
    with written_directory(directory) as tmp:
        meta = {"format": "pt", "step": str(step)}
        written = write_safetensors(tmp / WEIGHTS, tensors, shapes, metadata=meta)
        (tmp / CONFIG).write_text(cfg.to_yaml())
        tok.save(str(tmp / TOKENIZER))
        hashes = {WEIGHTS: written["sha256"], **{name: sha256(tmp / name) for name in (CONFIG, TOKENIZER)}}
        figures = {
            "step": step,
            "vocab_hash": vocab_hash(tok),
            "parameters": sum(math.prod(shape) for shape in shapes.values()),
            "sha256": hashes,
        }
        (tmp / META).write_text(json.dumps(figures, indent=2))
    return directory


def save_export(directory: Path, model: torch.nn.Module, cfg: Config, tok: Tokenizer, step: int) -> Path:
    """Export a model held whole in this process (``write_export`` of its state dict)."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    return write_export(directory, iter(state.items()), shapes, cfg, tok, step)


def load_export(directory: Path) -> tuple[Transformer, Config, Tokenizer]:
    """Read a checkpoint written by ``save_export``; clear errors for anything missing or foreign."""
    directory = Path(directory)
    missing = [n for n in (WEIGHTS, CONFIG, TOKENIZER) if not (directory / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{directory} is not a tpe-train checkpoint: {', '.join(missing)} missing; pass the "
            "directory written at the end of training (<run_dir>/checkpoint)"
        )
    try:
        cfg = validate(yaml.safe_load((directory / CONFIG).read_text()))
    except ConfigError as err:
        raise ConfigError(f"{directory / CONFIG}: {err}") from None
    tok = load_tokenizer(directory / TOKENIZER)
    meta_path = directory / META
    if meta_path.is_file():
        expected = json.loads(meta_path.read_text()).get("vocab_hash")
        if expected and expected != vocab_hash(tok):
            raise ValueError(
                f"{directory / TOKENIZER} does not match the vocabulary the weights were trained "
                "with (hash differs); restore the checkpoint's own tokenizer.json"
            )
    hashes = json.loads(meta_path.read_text()).get("sha256", {}) if meta_path.is_file() else {}
    for name, expected_hash in hashes.items():
        if sha256(directory / name) != expected_hash:
            raise ValueError(
                f"{directory / name} does not match the hash recorded in {meta_path} when it was written: "
                "the file was modified or corrupted; export the checkpoint again (tpe-ckpt export)"
            )
    model = build_model(model_args(cfg.model, tok.get_vocab_size()))
    state = load_file(str(directory / WEIGHTS))
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(
            f"{directory / WEIGHTS} does not fit the model of {directory / CONFIG}: missing "
            f"{result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}"
        )
    model.eval()
    return model, cfg, tok


def export_mean(sources: list[Path], out: Path) -> Path:
    """The mean of training checkpoints' fp32 weights (accumulated in fp64) as an export at ``out``,
    stamped with the last source's step; one source: that checkpoint. Consolidated offline from the
    checkpoints' shards one tensor at a time (memory: a few copies of the largest parameter); every
    file read is verified against its checkpoint's manifest first."""
    first = sources[0]
    cfg = validate(yaml.safe_load((first / CONFIG).read_text()))
    tok = load_tokenizer(first / TOKENIZER)
    with torch.device("meta"):
        shapes = {
            name: tuple(p.shape)
            for name, p in build_model(model_args(cfg.model, tok.get_vocab_size())).named_parameters()
        }
    indexes = []
    for path in sources:
        index = read_index(path)
        entries = index["tensors"]
        wrong = [n for n, shape in shapes.items() if n not in entries or tuple(entries[n]["shape"]) != shape]
        if wrong:
            raise CheckpointError(
                f"{path} holds another model than {first} ({wrong[0]} missing or of another shape); average "
                "checkpoints of one run"
            )
        verify(
            path,
            [CONFIG, TOKENIZER, TRAINER, *sorted({c["file"] for n in shapes for c in entries[n]["chunks"]})],
        )
        indexes.append(index)

    def mean() -> Iterator[tuple[str, torch.Tensor]]:
        for name in shapes:
            total = read_tensor(sources[0], indexes[0], name).double()
            for path, index in zip(sources[1:], indexes[1:], strict=True):
                total += read_tensor(path, index, name)
            yield name, (total / len(sources)).float()

    step = int(json.loads((sources[-1] / TRAINER).read_text())["step"])
    return write_export(out, mean(), shapes, cfg, tok, step)


def average_last(cfg: Config, run_dir: RunDir) -> tuple[Transformer, dict[str, Any]]:
    """The final model of ``eval.average_last`` N > 1: the mean of the run's last N complete
    checkpoints, exported to ``<run_dir>/averaged-lastN`` (what ``tpe-ckpt average`` writes), read back."""
    n = cfg.eval.average_last
    chosen = [e for e in entries(run_dir.checkpoints) if e.complete][-n:]
    if len(chosen) < n:
        print(f"tpe-train: eval.average_last={n}, but the run has {len(chosen)} complete checkpoints; "
              "averaging those")  # fmt: skip
    export = export_mean([e.path for e in chosen], run_dir.averaged(n))
    names = [e.path.name for e in chosen]
    print(f"tpe-train: final model = mean of {', '.join(names)} -> {export}")
    model, _, _ = load_export(export)
    return model, {"checkpoints": names, "export": str(export)}


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
