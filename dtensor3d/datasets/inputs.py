"""prepare-data's inputs: INPUT arguments -> an ordered list of files -> encoding tasks.

A file, a directory (walked recursively, in sorted order) or a glob (`**` recursive, sorted
matches); arguments keep the order they are given in. `--exclude GLOB` drops paths that
match. A plain file is one document; `.jsonl` holds one document per row (the field
`--text-field`); `.parquet` (optional `pyarrow`) one per row of that column.

A task is a small picklable unit of work for one encoding worker, about `TASK_BYTES` of
text: ("files", [paths]) — the worker reads them, skipping binary ones — ("jsonl", path,
first line number, [raw lines]) or ("texts", where, [strings]).
"""

from __future__ import annotations

import fnmatch
import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import DataError

TASK_BYTES = 1 << 20


def _walk(root: str) -> list[str]:
    found = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        found.extend(os.path.join(folder, f) for f in sorted(files))
    return found


def expand_inputs(inputs: list[str], exclude: list[str] = ()) -> list[str]:
    """Every input file, in order; a missing input or a glob matching nothing is a DataError."""
    files: list[str] = []
    for arg in inputs:
        if os.path.isdir(arg):
            files.extend(_walk(arg))
        elif os.path.isfile(arg):
            files.append(arg)
        elif glob.has_magic(arg):
            matches = sorted(glob.glob(arg, recursive=True))
            if not matches:
                raise DataError(f"input {arg!r}: the pattern matches no file")
            for m in matches:
                files.extend(_walk(m) if os.path.isdir(m) else [m] if os.path.isfile(m) else [])
        else:
            raise DataError(f"input {arg!r}: no such file or directory")
    kept = [f for f in files if not any(fnmatch.fnmatch(f, pattern) for pattern in exclude)]
    if not kept:
        raise DataError(f"inputs {' '.join(inputs)}: no file left to read (after --exclude)")
    return kept


@dataclass(frozen=True)
class Decoding:
    """How a plain text file's bytes become a document (prepare-data's --encoding options)."""

    encoding: str = "utf-8"
    errors: str = "replace"  # replace | skip | strict: what an undecodable file gets
    raw_bytes: bool = False  # the byte tokenizer: a file that does not decode is kept as its bytes


ENCODING_ERRORS = ("replace", "skip", "strict")
UTF8 = Decoding()  # the default: UTF-8, undecodable bytes replaced


def read_text_file(path: str, decoding: Decoding = UTF8) -> tuple[str | bytes | None, str]:
    """(the document, how it was read): "text"; "raw" (bytes, for the byte tokenizer);
    "replaced" (undecodable bytes replaced by U+FFFD); None with "binary" (a NUL byte) or
    "undecodable" (--encoding-errors skip). --encoding-errors strict raises a DataError."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise DataError(f"input {path!r} cannot be read: {e.strerror}") from None
    if b"\0" in data:
        return None, "binary"
    try:
        return data.decode(decoding.encoding), "text"
    except UnicodeDecodeError as e:
        if decoding.raw_bytes:
            return data, "raw"
        if decoding.errors == "strict":
            raise DataError(
                f"input {path!r} is not valid {decoding.encoding} (byte {e.start}); pass --encoding "
                "(e.g. latin-1) or --encoding-errors replace|skip"
            ) from None
        if decoding.errors == "skip":
            return None, "undecodable"
        return data.decode(decoding.encoding, "replace"), "replaced"


def _jsonl_tasks(path: str) -> Iterator[tuple]:
    lines, size, first = [], 0, 1
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            lines.append(line)
            size += len(line)
            if size >= TASK_BYTES:
                yield ("jsonl", path, first, lines)
                lines, size, first = [], 0, number + 1
    if lines:
        yield ("jsonl", path, first, lines)


def _parquet_tasks(path: str, field: str) -> Iterator[tuple]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"input {path!r}: reading .parquet needs pyarrow; pip install 'dtensor3d[parquet]'") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's own error types
        raise DataError(f"input {path!r} is not a readable parquet file: {str(e).splitlines()[0]}") from None
    if field not in pf.schema_arrow.names:
        raise DataError(f"input {path!r} has no column {field!r} (--text-field); columns: {pf.schema_arrow.names}")
    for batch in pf.iter_batches(columns=[field], batch_size=1024):
        yield ("texts", path, batch.column(0).to_pylist())


def plan_tasks(files: list[str], text_field: str) -> Iterator[tuple]:
    """Encoding tasks over `files`, in order (streamed: at most one task's text in memory)."""
    group, size = [], 0
    for path in files:
        kind = "jsonl" if path.endswith(".jsonl") else "parquet" if path.endswith(".parquet") else "file"
        if kind != "file" and group:
            yield ("files", group)
            group, size = [], 0
        if kind == "jsonl":
            yield from _jsonl_tasks(path)
        elif kind == "parquet":
            yield from _parquet_tasks(path, text_field)
        else:
            group.append(path)
            size += os.path.getsize(path)
            if size >= TASK_BYTES:
                yield ("files", group)
                group, size = [], 0
    if group:
        yield ("files", group)


def total_bytes(files: list[str]) -> int | None:
    """The input bytes the progress bar counts to (None when parquet makes it unknown)."""
    if any(f.endswith(".parquet") for f in files):
        return None
    return sum(os.path.getsize(f) for f in files)
