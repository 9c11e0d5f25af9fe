"""Joint subword vocabulary (BPE or unigram) trained with `tokenizers` on both sides of a corpus."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIALS = [PAD, BOS, EOS, UNK]  # ids 0, 1, 2, 3
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # what train_tokenizer guarantees


def train_tokenizer(
    texts: Iterable[str] | Iterable[list[str]], vocab_size: int, kind: str = "bpe"
) -> Tokenizer:
    """Train a joint tokenizer; Metaspace pre-tokenisation makes decode(encode(s)) == s for
    NFKC-normalised, single-spaced text."""
    if kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token=UNK))
        trainer: trainers.Trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False
        )
    elif kind == "unigram":
        tok = Tokenizer(models.Unigram())
        trainer = trainers.UnigramTrainer(
            vocab_size=vocab_size,
            special_tokens=SPECIALS,
            unk_token=UNK,
            show_progress=False,
        )
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r}; choose bpe or unigram")
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(texts, trainer=trainer)
    for i, special in enumerate(SPECIALS):
        if tok.token_to_id(special) != i:
            raise RuntimeError(f"special token {special} did not get id {i}")
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Read a ``tokenizer.json`` written by this module."""
    return Tokenizer.from_file(str(path))


def vocab_hash(tok: Tokenizer) -> str:
    """A short fingerprint of the vocabulary (checked when a run reuses a tokenizer)."""
    # token -> id, not the serialised model: unigram scores do not survive a save/load byte-exact
    vocab = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def encode(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens."""
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def decode(tok: Tokenizer, ids: list[list[int]]) -> list[str]:
    """Text of each id sequence (special tokens dropped)."""
    return tok.decode_batch(ids, skip_special_tokens=True)
