"""Corpus splits as `datasets` Datasets, tokenised with the joint vocabulary, and collation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import datasets
import numpy as np
import torch
from datasets import Dataset
from tokenizers import Tokenizer

from tpe_train.data import synthetic
from tpe_train.data.tokenizer import encode, load_tokenizer, train_tokenizer

if TYPE_CHECKING:
    from tpe_train.config import DataConfig

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
datasets.disable_progress_bars()  # one progress bar on the terminal: training's


@dataclass
class Splits:
    """Raw text pairs of each split; ``probe`` holds minimal pairs as consecutive rows (2i, 2i+1)."""

    train: list[synthetic.Pair]
    valid: list[synthetic.Pair]
    test: list[synthetic.Pair]
    long: list[synthetic.Pair]
    probe: list[synthetic.Pair]
    pretokenized: bool = True  # text is already split into words (" ." ends a sentence)


def synthetic_splits(cfg: DataConfig) -> Splits:
    """All splits of the embedded corpus; disjoint sources, a pure function of the config."""
    s = cfg.synthetic
    train = synthetic.generate(s.train_size, s.seed, s.min_words, s.max_words)
    seen = {src for src, _ in train}
    valid = synthetic.generate(s.valid_size, s.seed + 1, s.min_words, s.max_words, exclude=seen)
    seen |= {src for src, _ in valid}
    test = synthetic.generate(s.test_size, s.seed + 2, s.min_words, s.max_words, exclude=seen)
    seen |= {src for src, _ in test}
    long = (
        synthetic.generate(s.long_size, s.seed + 3, s.max_words + 1, s.long_max_words) if s.long_size else []
    )
    probes = synthetic.minimal_pairs(s.probe_size, s.seed + 4, s.probe_max_words, exclude=seen)
    probe = [pair for minimal in probes for pair in minimal]
    return Splits(train, valid, test, long, probe)


def get_tokenizer(cfg: DataConfig, texts: list[str], path: Path) -> Tokenizer:
    """Reuse ``path`` when it exists (same vocabulary size), else train on ``texts`` and save."""
    if path.exists():
        tok = load_tokenizer(path)
        if tok.get_vocab_size() != cfg.vocab_size:
            raise ValueError(
                f"{path} has a vocabulary of {tok.get_vocab_size()} but data.vocab_size is "
                f"{cfg.vocab_size}; delete the file to retrain it or set data.vocab_size"
            )
        return tok
    tok = train_tokenizer(texts, cfg.vocab_size, cfg.tokenizer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tok.save(str(tmp))
    tmp.replace(path)
    return tok


def to_dataset(pairs: list[synthetic.Pair], tok: Tokenizer) -> Dataset:
    """A Dataset with id, src, tgt, src_ids (+EOS), tgt_ids (+EOS), src_len, tgt_len."""
    ds = Dataset.from_dict(
        {
            "id": list(range(len(pairs))),
            "src": [p[0] for p in pairs],
            "tgt": [p[1] for p in pairs],
        }
    )

    def tokenize(batch: dict[str, list[str]]) -> dict[str, list[list[int]] | list[int]]:
        src = [[*ids, EOS_ID] for ids in encode(tok, batch["src"])]
        tgt = [[*ids, EOS_ID] for ids in encode(tok, batch["tgt"])]
        return {
            "src_ids": src,
            "tgt_ids": tgt,
            "src_len": [len(x) for x in src],
            "tgt_len": [len(x) for x in tgt],
        }

    return ds.map(tokenize, batched=True, batch_size=2000)


@dataclass
class Batch:
    """Padded tensors of one batch: src (B, Ls), tgt_in = BOS + target, tgt_out = target + EOS."""

    ids: torch.Tensor
    src: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor

    @property
    def target_tokens(self) -> int:
        return int((self.tgt_out != PAD_ID).sum())


def pad(seqs: list[list[int]], prefix: int | None = None) -> torch.Tensor:
    """Right-pad id lists into a (B, L) long tensor, optionally prefixing a token."""
    extra = 1 if prefix is not None else 0
    out = torch.full((len(seqs), max(len(s) for s in seqs) + extra), PAD_ID, dtype=torch.long)
    for i, s in enumerate(seqs):
        if prefix is not None:
            out[i, 0] = prefix
        out[i, extra : extra + len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def collate(ds: Dataset, indices: np.ndarray) -> Batch:
    rows = ds[indices.tolist()]
    tgt = rows["tgt_ids"]
    tgt_in = pad([t[:-1] for t in tgt], prefix=BOS_ID)
    return Batch(
        ids=torch.tensor(rows["id"]),
        src=pad(rows["src_ids"]),
        tgt_in=tgt_in,
        tgt_out=pad(tgt),
    )


def length_arrays(ds: Dataset) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(ds["src_len"]), np.asarray(ds["tgt_len"])


@dataclass
class Prepared:
    """What training needs: raw splits, the tokenizer, tokenised train and valid sets."""

    splits: Splits
    tokenizer: Tokenizer
    train: Dataset
    valid: Dataset
    dropped_too_long: int


def prepare(cfg: DataConfig, tokenizer_path: Path) -> Prepared:
    """Generate the corpus, train (or reuse) the joint tokenizer, tokenise, filter by length."""
    splits = synthetic_splits(cfg)
    texts = [s for s, _ in splits.train] + [t for _, t in splits.train]
    tok = get_tokenizer(cfg, texts, tokenizer_path)
    train = to_dataset(splits.train, tok)
    before = len(train)
    train = train.filter(
        lambda s, t: s <= cfg.max_len and t <= cfg.max_len,
        input_columns=["src_len", "tgt_len"],
    )
    if len(train) == 0:
        raise ValueError(
            f"no training pair is shorter than data.max_len={cfg.max_len} tokens; raise data.max_len"
        )
    return Prepared(splits, tok, train, to_dataset(splits.valid, tok), before - len(train))
