"""prepare-data's worker side: one task (datasets/inputs.py) -> token arrays per split.

Each document goes to the validation split when a keyed hash of its text falls below
`val_fraction` (`in_validation`): the split depends on the document alone, never on the
input order or on how the work is divided, so every `--workers` gives the same bytes.
Every document is followed by the end-of-document id; empty documents are dropped.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import numpy as np

from ..errors import DataError
from .inputs import read_text_file


def in_validation(text: str, fraction: float, seed: int) -> bool:
    """True for the documents of the validation split: blake2b(text, key=seed) / 2^64 < fraction."""
    if fraction <= 0.0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "little") < fraction * 2.0**64


@dataclass
class Chunk:
    """One task's output: per split the tokens (EOS after each document) and document lengths."""

    tokens: dict[str, np.ndarray] = field(default_factory=dict)
    lengths: dict[str, np.ndarray] = field(default_factory=dict)
    bytes_read: int = 0
    binary: int = 0
    empty: int = 0


def _row_text(line: bytes, text_field: str, where: str) -> str:
    try:
        row = json.loads(line)
    except ValueError as e:
        raise DataError(f"{where}: not a JSON object ({e})") from None
    if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
        raise DataError(f"{where}: no string field {text_field!r} (--text-field); keys: {sorted(row)[:8]}")
    return row[text_field]


def task_texts(task: tuple, text_field: str, chunk: Chunk) -> list[str]:
    """The documents of one task, in order; counts bytes and skipped binary files in `chunk`."""
    kind = task[0]
    if kind == "files":
        texts = []
        for path in task[1]:
            chunk.bytes_read += os.path.getsize(path)
            text = read_text_file(path)
            if text is None:
                chunk.binary += 1
            else:
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

    def __init__(self, tokenizer_json: str, eos_id: int, dtype: str, val_fraction: float, seed: int, text_field: str):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_str(tokenizer_json)
        self.tok.encode_special_tokens = True  # a literal "<|endoftext|>" in a document is text, not EOS
        self.eos, self.dtype = eos_id, np.dtype(dtype)
        self.val_fraction, self.seed, self.text_field = val_fraction, seed, text_field

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(tokens with EOS after each text, per-text lengths including the EOS)."""
        if not texts:
            return np.zeros(0, self.dtype), np.zeros(0, np.int64)
        ids = [e.ids for e in self.tok.encode_batch_fast(texts, add_special_tokens=False)]
        lengths = np.fromiter((len(x) + 1 for x in ids), np.int64, len(ids))
        flat = np.empty(int(lengths.sum()), self.dtype)
        ends = np.cumsum(lengths)
        flat[ends - 1] = self.eos
        starts = ends - lengths
        for start, x in zip(starts.tolist(), ids):
            flat[start : start + len(x)] = x
        return flat, lengths

    def __call__(self, task: tuple) -> Chunk:
        chunk = Chunk()
        texts = task_texts(task, self.text_field, chunk)
        kept = [t for t in texts if t]
        chunk.empty = len(texts) - len(kept)
        split = {"train": [], "val": []}
        for text in kept:
            split["val" if in_validation(text, self.val_fraction, self.seed) else "train"].append(text)
        for name, docs in split.items():
            chunk.tokens[name], chunk.lengths[name] = self.encode(docs)
        return chunk


def init_worker(args: tuple) -> None:
    """Pool initializer: one Encoder per worker process, one Rust thread each."""
    os.environ["RAYON_RS_NUM_CPUS"] = "1"
    _WORKER["encoder"] = Encoder(*args)


def run_task(task: tuple) -> Chunk:
    return _WORKER["encoder"](task)


# The Encoder of this worker process (set by init_worker); the parent never uses it.
_WORKER: dict[str, Encoder] = {}
