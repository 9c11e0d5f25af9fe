"""A folder written by ``datasets``' ``save_to_disk``, read as a folder from elsewhere: a token store's
``train``/``valid`` and a ``data.corpus=disk`` corpus.

``datasets.load_from_disk`` trusts the folder: a damaged ``state.json`` or ``dataset_info.json`` stops it
with a ``KeyError``, a ``JSONDecodeError`` or an ``AttributeError``, a cut Arrow file with an ``OSError``,
and an Arrow file with a damaged offset loads and then crashes the process (a segmentation fault) when
its rows are read. So each file is checked first, in the order ``load_from_disk`` reads them, and a
problem is one ``MemberError`` naming the file: ``state.json`` as JSON with the types ``load_from_disk``
reads, its data files as plain names of the folder (``members``), ``dataset_info.json`` as JSON that
``DatasetInfo`` accepts, and each Arrow file as a stream whose buffers and offsets are valid
(``Table.validate(full=True)``: it reads the offsets, not the token ids; milliseconds for 4.5M pairs).
The caller turns the error into its own class with its own fix (``load_saved``'s ``error`` and ``fix``).
"""

from __future__ import annotations

from pathlib import Path

import datasets
import pyarrow as pa
from datasets import Dataset

from tpe_train.run import members

STATE, INFO, SPLITS = "state.json", "dataset_info.json", "dataset_dict.json"
#: The keys of ``state.json`` that ``load_from_disk`` reads, with their types.
STATE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "_data_files": list,
    "_fingerprint": str,
    "_format_columns": (list, type(None)),
    "_format_kwargs": dict,
    "_format_type": (str, type(None)),
    "_output_all_columns": bool,
    "_split": (str, type(None)),
}
MAX_JSON = 16 * members.MIB


def load_saved(folder: Path, error: type[Exception], fix: str) -> Dataset:
    """The Dataset saved in ``folder``; a damaged file is an ``error`` naming it, ending with ``fix``."""
    try:
        return _load(Path(folder))
    except members.MemberError as err:
        raise error(str(err).replace(members.FIX, fix)) from None


def saved_splits(folder: Path, error: type[Exception], fix: str) -> list[str] | None:
    """The split names of a ``DatasetDict`` folder (its ``dataset_dict.json``), or None for a ``Dataset``
    folder; ``error`` when it is neither."""
    folder = Path(folder)
    try:
        if not (folder / SPLITS).exists():
            if not (folder / STATE).exists():
                raise members.MemberError(
                    f"{folder} is not a folder written by save_to_disk (it has no {SPLITS} or {STATE}); {fix}"
                )
            return None
        splits = members.read_json(folder, SPLITS, {"splits": list}, MAX_JSON)["splits"]
        return [members.check_name(name, folder / SPLITS) for name in splits]
    except members.MemberError as err:
        raise error(str(err).replace(members.FIX, fix)) from None


def _load(folder: Path) -> Dataset:
    state = members.read_json(folder, STATE, STATE_FIELDS, MAX_JSON)
    names = []
    for entry in state["_data_files"]:
        members.check_type(entry, dict, f"{folder / STATE}: a data file")
        names.append(members.check_name(entry.get("filename"), folder / STATE))
    info = members.read_json(folder, INFO, None, MAX_JSON)
    try:
        datasets.DatasetInfo.from_dict(info)
    except Exception as err:  # datasets' parser of the features raises whatever the JSON leads it to
        raise members.MemberError(
            f"{folder / INFO} is not a dataset's description ({_short(err)}); {members.FIX}"
        ) from None
    for name in names:
        _check_arrow(folder, name)
    try:
        loaded = datasets.load_from_disk(str(folder))
    except Exception as err:  # each file reads: they do not fit together
        raise members.MemberError(
            f"the files of {folder} ({STATE}, {INFO} and {', '.join(names) or 'no data file'}) do not fit "
            f"together ({_short(err)}); {members.FIX}"
        ) from None
    if not isinstance(loaded, Dataset):
        raise members.MemberError(f"{folder} holds a DatasetDict, where one split is expected; {members.FIX}")
    return loaded


def _check_arrow(folder: Path, name: str) -> None:
    """Stop unless ``folder/name`` is an Arrow stream whose every buffer and offset is valid."""
    path = members.check_file(folder, name)
    try:
        with pa.memory_map(str(path)) as source:
            pa.ipc.open_stream(source).read_all().validate(full=True)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as err:  # a cut file: OSError; a name: Unicode
        problem = f"is not a readable Arrow file ({_short(err)})"
        raise members.MemberError(f"{path} {problem}; {members.FIX}") from None


def _short(err: BaseException) -> str:
    text = " ".join(str(err).split())[:200]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
