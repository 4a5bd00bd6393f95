"""prepare-data's worker side: one task (datasets/inputs.py) -> token arrays per split.

Each document goes to the validation split when a keyed hash of its text falls below
`val_fraction` (`in_validation`): the split depends on the document alone, never on the
input order or on how the work is divided, so every `--workers` gives the same bytes.
Every document is followed by the end-of-document id; empty documents are dropped.

In one process (`--workers 1`), `Encoder.stream` hands GROUP tasks (about 8 MB of text) at a
time to the Rust tokenizer's `encode_batch_fast` (no character offsets; its own thread pool,
one thread per core; the GIL released), on a helper thread, so that encoding one group
overlaps reading the next and writing the previous. A group is one Chunk: the bytes written
do not depend on how tasks are grouped.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ..errors import DataError
from .inputs import UTF8, Decoding, read_text_file

GROUP = 8  # tasks (about inputs.TASK_BYTES each) per encode_batch_fast call of Encoder.stream


def in_validation(text: str | bytes, fraction: float, seed: int) -> bool:
    """True for the documents of the validation split: blake2b(text, key=seed) / 2^64 < fraction
    (a document kept as raw bytes is hashed as those bytes)."""
    if fraction <= 0.0:
        return False
    data = text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(data, digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "little") < fraction * 2.0**64


@dataclass
class Chunk:
    """One task's output: per split the tokens (EOS after each document) and document lengths."""

    tokens: dict[str, np.ndarray] = field(default_factory=dict)
    lengths: dict[str, np.ndarray] = field(default_factory=dict)
    bytes_read: int = 0
    binary: int = 0
    empty: int = 0
    undecodable: int = 0
    replaced: int = 0
    named: dict[str, list[str]] = field(default_factory=dict)  # kind -> the first NAMED files of it

    def note(self, kind: str, path: str) -> None:
        """Count a file skipped (binary, undecodable, empty) or decoded with replacement, by name."""
        if kind != "empty":  # empty documents are counted where they are dropped (Encoder.read)
            setattr(self, kind, getattr(self, kind) + 1)
        names = self.named.setdefault(kind, [])
        if len(names) < NAMED:
            names.append(path)


NAMED = 3  # files named per kind in prepare-data's summary (then a count)


def _row_text(line: bytes, text_field: str, where: str) -> str:
    try:
        row = json.loads(line)
    except ValueError as e:
        raise DataError(f"{where}: not a JSON object ({e})") from None
    if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
        what = f"keys: {sorted(row)[:8]}" if isinstance(row, dict) else f"a JSON {type(row).__name__}, not an object"
        raise DataError(f"{where}: no string field {text_field!r} (--text-field); {what}")
    return row[text_field]


def task_texts(task: tuple, text_field: str, chunk: Chunk, decoding: Decoding = UTF8) -> list[str | bytes]:
    """The documents of one task, in order; counts bytes and names skipped files in `chunk`."""
    kind = task[0]
    if kind == "files":
        texts = []
        for path in task[1]:
            chunk.bytes_read += os.path.getsize(path)
            text, how = read_text_file(path, decoding)
            if how in ("binary", "undecodable", "replaced") or not text:
                chunk.note(how if how != "text" else "empty", path)
            if text is not None:
                texts.append(text)
        return texts
    if kind == "jsonl":
        _, path, first, lines = task
        chunk.bytes_read += sum(len(line) for line in lines)
        return [_row_text(ln, text_field, f"{path}:{first + i}") for i, ln in enumerate(lines) if ln.strip()]
    texts = ["" if t is None else str(t) for t in task[2]]
    chunk.bytes_read += sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    return texts


class Encoder:
    """Turns tasks into Chunks with one tokenizer (a tokenizer.json string, so it pickles)."""

    def __init__(self, tokenizer_json: str, eos_id: int, dtype: str, val_fraction: float, seed: int, text_field: str,
                 decoding: Decoding = UTF8):  # fmt: skip
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_str(tokenizer_json)
        self.tok.encode_special_tokens = True  # a literal "<|endoftext|>" in a document is text, not EOS
        self.eos, self.dtype = eos_id, np.dtype(dtype)
        self.val_fraction, self.seed, self.text_field, self.decoding = val_fraction, seed, text_field, decoding

    def encode(self, texts: list[str | bytes]) -> list[list[int]]:
        """The ids of each text (one encode_batch_fast call: the Rust tokenizer's threads); a
        document kept as raw bytes (the byte tokenizer only) is its byte values."""
        strings = [t for t in texts if isinstance(t, str)]
        encoded = iter(self.tok.encode_batch_fast(strings, add_special_tokens=False) if strings else [])
        return [next(encoded).ids if isinstance(t, str) else list(t) for t in texts]

    def flat(self, ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """(the ids with EOS after each document, per-document lengths including the EOS)."""
        lengths = np.fromiter((len(x) + 1 for x in ids), np.int64, len(ids))
        flat = np.empty(int(lengths.sum()), self.dtype)
        ends = np.cumsum(lengths)
        flat[ends - 1] = self.eos
        for start, x in zip((ends - lengths).tolist(), ids):
            flat[start : start + len(x)] = x
        return flat, lengths

    def read(self, tasks: list[tuple]) -> tuple[Chunk, dict[str, list[str]]]:
        """The documents of `tasks`, in order, per split; the counts in a fresh Chunk."""
        chunk, split = Chunk(), {"train": [], "val": []}
        for task in tasks:
            texts = task_texts(task, self.text_field, chunk, self.decoding)
            kept = [t for t in texts if t]
            chunk.empty += len(texts) - len(kept)
            for text in kept:
                split["val" if in_validation(text, self.val_fraction, self.seed) else "train"].append(text)
        return chunk, split

    def fill(self, chunk: Chunk, split: dict[str, list[str]]) -> Chunk:
        """Encode both splits in one batch and put their token arrays into `chunk`."""
        ids, n = self.encode(split["train"] + split["val"]), len(split["train"])
        chunk.tokens["train"], chunk.lengths["train"] = self.flat(ids[:n])
        chunk.tokens["val"], chunk.lengths["val"] = self.flat(ids[n:])
        return chunk

    def __call__(self, task: tuple) -> Chunk:
        return self.fill(*self.read([task]))

    def stream(self, tasks: Iterator[tuple]) -> Iterator[Chunk]:
        """One Chunk per GROUP tasks, in order; a group is encoded on a helper thread while
        the caller writes the previous Chunk and this thread reads the next group."""
        with ThreadPoolExecutor(1, thread_name_prefix="encode") as pool:
            pending = None
            for group in _groups(tasks, GROUP):
                future = pool.submit(self.fill, *self.read(group))
                if pending is not None:
                    yield pending.result()
                pending = future
            if pending is not None:
                yield pending.result()


def _groups(tasks: Iterator[tuple], size: int) -> Iterator[list[tuple]]:
    group = []
    for task in tasks:
        group.append(task)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def init_worker(args: tuple) -> None:
    """Pool initializer: one Encoder per worker process, one Rust thread each."""
    os.environ["RAYON_RS_NUM_CPUS"] = "1"
    _WORKER["encoder"] = Encoder(*args)


def run_task(task: tuple) -> Chunk:
    return _WORKER["encoder"](task)


# The Encoder of this worker process (set by init_worker); the parent never uses it.
_WORKER: dict[str, Encoder] = {}
