"""A split's parquet files read as a stream of ``src``/``tgt`` pairs (``data.streaming`` with
``data.corpus=parquet``), where a damaged file stops with a ``CorpusError`` naming it.

``datasets``' own streamed parquet reader lets pyarrow's ``OSError``, ``ArrowInvalid`` and
``UnicodeDecodeError`` out while it iterates, when a page inside a file is damaged but the footer reads
(``parquet_files`` has read every footer before). Here every row group is one shard of the stream (so
``split_dataset_by_node`` gives the ranks whole row groups), only the columns of the pair are read (the
``src``/``tgt`` strings or the two languages of the ``translation`` records), and each record batch is
validated (offsets, UTF-8) and checked for missing values before a pair is taken from it. Each check
names the file, the row group and the fix.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from datasets import Features, IterableDataset, Value

from tpe_train.data.errors import CorpusError

BATCH_ROWS = 1024
#: One piece of a split: a parquet file, one of its row groups, and the columns of the pair to read
#: (``[src, tgt]``, or ``[translation]`` with the source and target language).
Piece = tuple[str, int, list[str], str, str]


def stream_parquet(files: list[str], src_lang: str, tgt_lang: str) -> IterableDataset:
    """The pairs of ``files`` (every footer already read by ``parquet_files``) as an IterableDataset."""
    pieces: list[Piece] = []
    for name in files:
        meta = pq.read_metadata(name)
        try:
            schema = meta.schema.to_arrow_schema()
        except (pa.ArrowException, OSError) as err:
            raise CorpusError(f"{name} has a schema that Arrow cannot read ({err}); {_fix(name)}") from None
        columns = pair_columns(schema, name, src_lang, tgt_lang)
        pieces += [(name, group, columns, src_lang, tgt_lang) for group in range(meta.num_row_groups)]
    features = Features({"src": Value("string"), "tgt": Value("string")})
    return IterableDataset.from_generator(_pairs, features=features, gen_kwargs={"pieces": pieces})


def pair_columns(schema: pa.Schema, name: str, src_lang: str, tgt_lang: str) -> list[str]:
    """The columns of a file that hold its pairs, or a ``CorpusError`` naming what is missing."""
    text = (pa.string(), pa.large_string())
    fields = {field.name: field.type for field in schema}
    if fields.get("src") in text and fields.get("tgt") in text:
        return ["src", "tgt"]
    record = fields.get("translation")
    if not isinstance(record, pa.StructType):
        raise CorpusError(
            f"{name} has columns {list(fields)}; expected 'translation' records "
            '({"translation": {"de": ..., "en": ...}}) or string columns src and tgt'
        )
    langs = {record.field(i).name: record.field(i).type for i in range(record.num_fields)}
    missing = [lang for lang in (src_lang, tgt_lang) if langs.get(lang) not in text]
    if missing:
        raise CorpusError(
            f"{name} has no language {', '.join(missing)} as text (it has {', '.join(langs)}); set "
            "data.src_lang / data.tgt_lang to languages of the corpus"
        )
    return ["translation"]


def _pairs(pieces: list[Piece]) -> Iterator[dict[str, str]]:
    for name, group, columns, src_lang, tgt_lang in pieces:
        for batch in checked_batches(name, group, columns):
            if columns == ["src", "tgt"]:
                src, tgt = batch.column(0), batch.column(1)
            else:
                record = batch.column(0)  # flatten: a missing record is a missing side
                sides = record.flatten()
                src, tgt = (sides[record.type.get_field_index(lang)] for lang in (src_lang, tgt_lang))
            for pair in zip(src.to_pylist(), tgt.to_pylist(), strict=True):
                if None in pair:
                    where = f"{name}: row group {group}"
                    raise CorpusError(f"{where} has a pair with a missing (null) side; {_fix(name)}")
                yield {"src": pair[0], "tgt": pair[1]}


def checked_batches(name: str, group: int, columns: list[str] | None) -> Iterator[pa.RecordBatch]:
    """The record batches of one row group of ``name`` (``columns``: those only), each validated in full
    (offsets, UTF-8)."""
    try:
        with pq.ParquetFile(name) as reader:
            for batch in reader.iter_batches(batch_size=BATCH_ROWS, row_groups=[group], columns=columns):
                batch.validate(full=True)
                yield batch
    except (pa.ArrowException, OSError) as err:  # pyarrow reports some damaged pages as an OSError
        why = " ".join(str(err).split())[:200]
        raise CorpusError(f"{name}: row group {group} cannot be read ({why}); {_fix(name)}") from None


def damaged_file(files: list[str]) -> None:
    """Read every row group of ``files``: a ``CorpusError`` naming the first that cannot be read."""
    for name in files:
        for group in range(pq.read_metadata(name).num_row_groups):
            for _ in checked_batches(name, group, None):
                pass


def _fix(name: str) -> str:
    return f"the file is damaged: download or write it again, or move it out of {Path(name).parent}"
