"""The ``datasets`` cache files one preparation writes on its way to the token store, and their removal
once the store holds the result."""

from __future__ import annotations

from pathlib import Path

from datasets import Dataset


def made_files(*datasets: Dataset) -> set[str]:
    """The ``cache-*.arrow`` files behind these Datasets: what ``datasets`` wrote for a map or a filter
    (a hub download, a parquet conversion or a save_to_disk directory has other names)."""
    files = {f["filename"] for ds in datasets for f in ds.cache_files}
    return {f for f in files if Path(f).name.startswith("cache-") and f.endswith(".arrow")}


def drop_scratch(files: set[str]) -> None:
    """Delete the cache files this preparation's maps and filters wrote, once the store holds their
    result (at WMT scale several copies of the corpus: flattened, cleaned, tokenised). Only the files
    this process's Datasets were backed by; the converted corpus itself stays, so a later preparation
    with other settings starts from it (and redoes the maps). Not ``Dataset.cleanup_cache_files``:
    that empties the whole cache directory, including files another preparation is writing."""
    for name in sorted(files):
        Path(name).unlink(missing_ok=True)
