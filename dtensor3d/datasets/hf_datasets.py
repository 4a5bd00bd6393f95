"""prepare-data --hf-dataset: Hugging Face datasets as encoding tasks (the optional `datasets`
extra). A directory written by `save_to_disk` (a Dataset, or a DatasetDict and --split) is
read from its memory-mapped Arrow files; anything else goes to `datasets.load_dataset(...,
streaming=True)` (a local dataset directory or script, or a hub name where the hub is
reachable). Either way rows arrive in batches, never the whole dataset at once.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from ..errors import DataError

BATCH = 1024


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def open_dataset(source: str, split: str):
    try:
        import datasets
    except ImportError:
        raise DataError("--hf-dataset needs the datasets package; pip install 'dtensor3d[hf]'") from None
    saved = any(os.path.isfile(os.path.join(source, f)) for f in ("state.json", "dataset_dict.json"))
    try:
        if not saved:
            return datasets.load_dataset(source, split=split, streaming=True)
        ds = datasets.load_from_disk(source)
    except Exception as e:  # datasets raises many kinds (FileNotFoundError, DatasetNotFoundError, ...)
        raise DataError(f"--hf-dataset {source!r} (split {split!r}) cannot be opened: {_first_line(e)}") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"--hf-dataset {source!r} has no split {split!r}; splits: {', '.join(ds)}")
        ds = ds[split]
    return ds


def hf_tasks(source: str, split: str, text_field: str) -> Iterator[tuple]:
    """("texts", where, [strings]) tasks of BATCH rows each, in the dataset's order."""
    ds = open_dataset(source, split)
    names = getattr(ds, "column_names", None)
    if names is not None and text_field not in names:
        raise DataError(f"--hf-dataset {source!r} has no column {text_field!r} (--text-field); columns: {names}")
    where = f"{source}:{split}"
    for batch in ds.iter(batch_size=BATCH):
        if text_field not in batch:
            raise DataError(f"--hf-dataset {source!r} rows have no field {text_field!r}; fields: {sorted(batch)}")
        yield ("texts", where, batch[text_field])
