"""Exports: safetensors weights + resolved config + tokenizer + hashes, what ``tpe-eval`` reads.

An export is consolidated offline from a training checkpoint's shards (or the mean of several), one
tensor at a time, written under a temporary name and renamed into place only when complete, so an
interrupted export never leaves a half-written directory where a reader looks.
"""

from __future__ import annotations

import json
import logging
import math
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from tokenizers import Tokenizer

from tpe_train.ckpt.rundir import CONFIG, EVAL, TOKENIZER, RunDir
from tpe_train.ckpt.shards import read_index, read_tensor, write_safetensors
from tpe_train.ckpt.store import MANIFEST, TRAINER, CheckpointError, entries, read_yaml, sha256, verify
from tpe_train.config import Config, ConfigError, legacy, validate
from tpe_train.data.batching import model_args
from tpe_train.data.tokenizer import vocab_hash
from tpe_train.model.build import build_model
from tpe_train.model.transformer import Transformer
from tpe_train.run import members, readers
from tpe_train.run.outputs import check_output, files_of, written_directory

log = logging.getLogger(__name__)

#: An export's files besides ``CONFIG`` and ``TOKENIZER``: the weights, and hashes and step.
WEIGHTS, META = "model.safetensors", "meta.json"
#: The kind of output (run.outputs) of each export format, whichever command writes it.
KINDS = {"native": "export", "hf": "export-hf", "ctranslate2": "export-ctranslate2"}
EXPORT = KINDS["native"]


def legacy_export(path: Path) -> bool:
    """Whether ``path`` is a native export written before output markers existed, holding nothing but
    an export's files and what evaluation adds (``eval.json``, ``hypotheses/``)."""
    files = files_of(path)
    ours = {WEIGHTS, CONFIG, TOKENIZER, META, EVAL}
    return {WEIGHTS, META} <= set(files) and all(f in ours or f.startswith("hypotheses/") for f in files)


def check_export_out(out: Path, command: str, sources: list[Path] | tuple[Path, ...] = ()) -> None:
    """Refuse an ``out`` that a native export may not write or replace (before any long work)."""
    check_output(out, command, EXPORT, sources, legacy_export, RunDir.what)


def write_export(
    directory: Path,
    tensors: Iterator[tuple[str, torch.Tensor]],
    shapes: dict[str, tuple[int, ...]],
    cfg: Config,
    tok: Tokenizer,
    step: int,
    command: str = "tpe-train",
    sources: list[Path] | tuple[Path, ...] = (),
) -> Path:
    """Write weights (``tensors``, one at a time, in the order of ``shapes``), config, tokenizer and
    metadata to ``directory`` atomically (``run.outputs``: ``command`` writing, ``sources`` read)."""
    directory = Path(directory)
    with written_directory(directory, command, EXPORT, sources, legacy_export, RunDir.what) as tmp:
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


def save_export(
    directory: Path,
    model: torch.nn.Module,
    cfg: Config,
    tok: Tokenizer,
    step: int,
    command: str = "tpe-train",
    sources: list[Path] | tuple[Path, ...] = (),
) -> Path:
    """Export a model held whole in this process (``write_export`` of its state dict)."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    return write_export(directory, iter(state.items()), shapes, cfg, tok, step, command, sources)


def load_export(directory: Path) -> tuple[Transformer, Config, Tokenizer]:
    """Read a checkpoint written by ``save_export``; clear errors for anything missing or foreign."""
    directory = Path(directory)
    with readers.reading(RunDir.readers_root(directory)):
        return _load_export(directory)


def read_meta(directory: Path) -> dict[str, Any]:
    """An export's ``meta.json`` (empty without one), checked: its hashes name plain files of the export."""
    if not (directory / META).exists() and not (directory / META).is_symlink():
        return {}
    fields = {"step": int, "sha256": dict}
    meta = members.read_json(directory, META, fields, members.MIB, CheckpointError)
    for name, digest in meta["sha256"].items():
        members.check_name(name, directory / META, error=CheckpointError)
        members.check_type(digest, str, f"{directory / META}: sha256[{name!r}]", CheckpointError)
    members.check_type(meta.get("vocab_hash", ""), str, f"{directory / META}: vocab_hash", CheckpointError)
    return meta


def _load_export(directory: Path) -> tuple[Transformer, Config, Tokenizer]:
    if (directory / MANIFEST).is_file():  # known by its manifest, wherever it lies and however named
        raise CheckpointError(
            f"{directory} is a training checkpoint (it holds a manifest.json), not an export; export it "
            f"first (tpe-ckpt export {shlex.quote(str(directory))} --out DIR) and pass DIR"
        )
    missing = [n for n in (WEIGHTS, CONFIG, TOKENIZER) if not (directory / n).exists()]
    if missing:
        raise FileNotFoundError(
            f"{directory} is not a tpe-train checkpoint: {', '.join(missing)} missing; pass the "
            "directory written at the end of training (<run_dir>/checkpoint)"
        )
    meta = read_meta(directory)
    for name, expected_hash in meta.get("sha256", {}).items():
        if members.sha256(directory, name, CheckpointError) != expected_hash:
            raise CheckpointError(
                f"{directory / name} does not match the hash recorded in {directory / META} when it was "
                "written: the file was modified or corrupted; export the checkpoint again (tpe-ckpt export)"
            )
    cfg, tok = read_setup(directory)
    expected = meta.get("vocab_hash")
    if expected and expected != vocab_hash(tok):
        raise CheckpointError(
            f"{directory / TOKENIZER} does not match the vocabulary the weights were trained "
            "with (hash differs); restore the checkpoint's own tokenizer.json"
        )
    model = build_model(model_args(cfg.model, tok.get_vocab_size()))
    try:
        state = load_file(str(members.check_file(directory, WEIGHTS, error=CheckpointError)))
        result = model.load_state_dict(state, strict=False)
    except (SafetensorError, RuntimeError) as err:  # not safetensors; tensors of other shapes or types
        raise CheckpointError(
            f"{directory / WEIGHTS} cannot be read into the model of {directory / CONFIG} "
            f"({str(err)[:300]}); {members.FIX}"
        ) from None
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointError(
            f"{directory / WEIGHTS} does not fit the model of {directory / CONFIG}: missing "
            f"{result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}"
        )
    model.eval()
    return model, cfg, tok


def read_setup(directory: Path) -> tuple[Config, Tokenizer]:
    """The config and the tokenizer of a checkpoint or an export, read as files of that folder."""
    loaded = legacy.fill(read_yaml(directory, CONFIG))  # written before a key was added: its old meaning
    try:
        cfg = validate(loaded)
    except ConfigError as err:
        raise ConfigError(f"{directory / CONFIG}: {err}") from None
    text = members.read_text(directory, TOKENIZER, error=CheckpointError)
    try:
        tok = Tokenizer.from_str(text)
    except Exception as err:  # the tokenizers library raises its own exception type
        raise CheckpointError(f"{directory / TOKENIZER} is not a tokenizer ({err}); {members.FIX}") from None
    return cfg, tok


def export_mean(sources: list[Path], out: Path, command: str = "tpe-train") -> Path:
    """The mean of training checkpoints' fp32 weights (accumulated in fp64) as an export at ``out``,
    stamped with the last source's step; one source: that checkpoint. Consolidated offline from the
    checkpoints' shards one tensor at a time (memory: a few copies of the largest parameter); every
    file read is verified against its checkpoint's manifest first (after ``out`` is checked)."""
    check_export_out(out, command, sources)
    first = sources[0]
    cfg, tok = read_setup(first)
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

    step = members.read_json(sources[-1], TRAINER, {"step": int}, error=CheckpointError)["step"]
    return write_export(out, mean(), shapes, cfg, tok, step, command, sources)


def average_last(cfg: Config, run_dir: RunDir) -> tuple[Transformer, dict[str, Any]]:
    """The final model of ``eval.average_last`` N > 1: the mean of the run's last N complete
    checkpoints, exported to ``<run_dir>/averaged-lastN`` (what ``tpe-ckpt average`` writes), read back."""
    n = cfg.eval.average_last
    chosen = [e for e in entries(run_dir.checkpoints) if e.complete][-n:]
    if len(chosen) < n:
        log.warning(
            "eval.average_last=%d, but the run has %d complete checkpoints; averaging those", n, len(chosen)
        )
    with readers.reading(run_dir.checkpoints):
        export = export_mean([e.path for e in chosen], run_dir.averaged(n))
    names = [e.path.name for e in chosen]
    log.info("final model = mean of %s -> %s", ", ".join(names), export)
    model, _, _ = load_export(export)
    return model, {"checkpoints": names, "export": str(export)}


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
