"""Streaming batches: ranks split the stream, token limits hold, a restored state is exact."""

from __future__ import annotations

import itertools

from datasets import Dataset

from tpe_train.data import synthetic
from tpe_train.data.streaming import StreamingBatches
from tpe_train.data.tokenizer import train_tokenizer

PAIRS = synthetic.generate(400, 7, 4, 20)
TOK = train_tokenizer([s for p in PAIRS for s in p], 200)


def stream(**kw: int) -> StreamingBatches:
    source = Dataset.from_dict(
        {"id": list(range(len(PAIRS))), "src": [p[0] for p in PAIRS], "tgt": [p[1] for p in PAIRS]}
    )
    return StreamingBatches(source.to_iterable_dataset(num_shards=4), TOK, max_tokens=400, seed=3, **kw)


def ids_of(batches: list) -> list[list[int]]:  # type: ignore[type-arg]
    return [b.ids.tolist() for b in batches]


def test_ranks_split_the_stream_each_pair_once_per_epoch_within_the_token_limit() -> None:
    per_rank = []
    for rank in range(2):
        it = stream(dp_rank=rank, dp_size=2, buffer_size=50)
        ids: list[int] = []
        for batch in iter(it):
            if it.epoch:  # the first batch of the next epoch
                break
            width = batch.src.shape[1] + batch.tgt_out.shape[1]
            assert width * len(batch.ids) <= 400 or len(batch.ids) == 1
            ids += batch.ids.tolist()
        per_rank.append(ids)
    assert not set(per_rank[0]) & set(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == list(range(len(PAIRS)))


def test_same_seed_same_batches() -> None:
    a = ids_of(list(itertools.islice(iter(stream(buffer_size=64)), 12)))
    b = ids_of(list(itertools.islice(iter(stream(buffer_size=64)), 12)))
    assert a == b


def test_restored_state_continues_exactly() -> None:
    reference = ids_of(list(itertools.islice(iter(stream(buffer_size=64)), 40)))  # crosses an epoch
    first = stream(buffer_size=64)
    it = iter(first)
    head = ids_of([next(it) for _ in range(13)])
    state = first.state_dict()
    resumed = stream(buffer_size=64)
    resumed.load_state_dict(state)
    tail = ids_of(list(itertools.islice(iter(resumed), 27)))
    assert head + tail == reference


def test_text_corpus_streams_lazily_and_reports_misalignment(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import gzip

    import pytest

    from tpe_train.data.sources import CorpusError, SourceSpec, stream_split

    (tmp_path / "train.en").write_text("a b\nc d\ne f\n")
    (tmp_path / "train.de.gz").write_bytes(gzip.compress(b"A B\nC D\nE F\n"))
    spec = SourceSpec(kind="text", src_lang="en", tgt_lang="de", path=str(tmp_path))
    assert [(r["src"], r["tgt"]) for r in stream_split(spec, "train")] == [
        ("a b", "A B"),
        ("c d", "C D"),
        ("e f", "E F"),
    ]
    (tmp_path / "train.en").write_text("a b\nc d\n")
    with pytest.raises(CorpusError, match="ends at line 2 but the other side goes on"):
        list(stream_split(spec, "train"))


def test_training_streams_a_text_corpus_end_to_end(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for split, seed in (("train", 1), ("validation", 2), ("test", 3)):
        pairs = synthetic.generate(200 if split == "train" else 10, seed, 4, 12)
        (corpus / f"{split}.en").write_text("".join(s + "\n" for s, _ in pairs))
        (corpus / f"{split}.de").write_text("".join(t + "\n" for _, t in pairs))
    cmd = [
        sys.executable, "-m", "tpe_train.train", "data.corpus=text", f"data.path={corpus}",
        "data.streaming=true",
        "data.shuffle_buffer=50", "data.vocab_size=150", "data.max_tokens=600", "model.d_model=32",
        "model.ffn_dim=64", "model.encoder_layers=1", "model.decoder_layers=1", "train.max_steps=4",
        "train.valid_every=4", "train.valid_bleu_size=2", "train.progress=false", "eval.beam=1",
        f"train.run_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "streamed training pairs" in proc.stdout
    assert (tmp_path / "run" / "checkpoint" / "model.safetensors").is_file()
