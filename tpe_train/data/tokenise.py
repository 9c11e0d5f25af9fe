"""Tokenise: the pipeline's fourth stage. The joint tokenizer learned on a sample of the cleaned training
pairs, src/tgt text turned into token ids (+EOS) and lengths, and the training pairs longer than the
length limit dropped (data/lengths.py: the one length rule).

(Not ``tokenize.py``: that name would hide the standard library's ``tokenize`` module, which the
traceback machinery imports, from a script run inside this folder.)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from datasets import Dataset, Features, Sequence, Value
from tokenizers import Tokenizer

from tpe_train.data.errors import CorpusError
from tpe_train.data.lengths import fits
from tpe_train.data.tokenizer import EOS_ID, encode, train_tokenizer


@dataclass(frozen=True, kw_only=True)
class TokenizerSpec:
    """The joint tokenizer to learn (a plain mirror of the ``data`` section's tokenizer settings)."""

    kind: str = "bpe"  # bpe | unigram
    vocab_size: int = 8000
    sample: int = 1_000_000  # training pairs it is learned on


def learn_tokenizer(train: Dataset, spec: TokenizerSpec) -> Tokenizer:
    """The joint tokenizer of a src/tgt Dataset, learned on ``spec.sample`` of its pairs."""
    return train_tokenizer(texts(sample(train, spec.sample)), spec.vocab_size, spec.kind)


def sample(train: Dataset, n: int) -> Dataset:
    """``n`` pairs spread evenly over the corpus (every k-th; the whole corpus when it has at most
    ``n``): the tokenizer's training text, as WMT recipes learn BPE on a sample. Deterministic."""
    if len(train) <= n:
        return train
    step = len(train) / n
    return train.select(int(i * step) for i in range(n))


def texts(train: Dataset) -> Iterator[list[str]]:
    """The source side, then the target side, 10,000 lines at a time."""
    for column in ("src", "tgt"):
        for start in range(0, len(train), 10_000):
            yield train[start : start + 10_000][column]


def token_features(vocab_size: int, text: bool) -> Features:
    """The stored columns: token ids as uint16 when the vocabulary fits in 16 bits (every preset's
    does: 37,000 for WMT), else int32; lengths int32; ``text``: the src/tgt strings too. At 4.5M WMT
    pairs int64 ids and the training text made a 3.9 GB store; training reads neither the text nor
    more than 16 bits of an id (benchmarks/bench_wmt_scale.py)."""
    ids = Value("uint16" if vocab_size <= 2**16 else "int32")
    columns = {"src": Value("string"), "tgt": Value("string")} if text else {}
    columns |= {"id": Value("int64"), "src_ids": Sequence(ids), "tgt_ids": Sequence(ids)}
    return Features({**columns, "src_len": Value("int32"), "tgt_len": Value("int32")})


def to_dataset(ds: Dataset, tok: Tokenizer, num_proc: int | None = None, text: bool = True) -> Dataset:
    """Add id, src_ids (+EOS), tgt_ids (+EOS), src_len, tgt_len to a src/tgt Dataset (``text``: keep
    the src/tgt strings; the training split drops them)."""

    def tokenize(batch: dict[str, list[str]], idx: list[int]) -> dict[str, list[list[int]] | list[int]]:
        src = [[*ids, EOS_ID] for ids in encode(tok, batch["src"])]
        tgt = [[*ids, EOS_ID] for ids in encode(tok, batch["tgt"])]
        return {
            "id": idx,
            "src_ids": src,
            "tgt_ids": tgt,
            "src_len": [len(x) for x in src],
            "tgt_len": [len(x) for x in tgt],
        }

    return ds.map(
        tokenize,
        batched=True,
        batch_size=2000,
        with_indices=True,
        num_proc=num_proc,
        features=token_features(tok.get_vocab_size(), text),
        remove_columns=None if text else ["src", "tgt"],
    )


def drop_too_long(train: Dataset, max_len: int) -> tuple[Dataset, int]:
    """The tokenised pairs that fit ``max_len`` on both sides, and how many did not; a ``CorpusError``
    when none does."""
    before = len(train)
    train = train.filter(
        lambda s, t: fits(np.asarray(s), np.asarray(t), max_len),
        input_columns=["src_len", "tgt_len"],
        batched=True,
        batch_size=10_000,
    )
    if len(train) == 0:
        raise CorpusError(
            f"no training pair is shorter than data.max_len={max_len} tokens; raise data.max_len"
        )
    return train, before - len(train)
