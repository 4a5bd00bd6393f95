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
from .pieces import PIECE, Pieces, encode_long

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
    masks: dict[str, np.ndarray] = field(default_factory=dict)  # --chat: 1 where a token counts in the loss
    bytes_read: int = 0
    binary: int = 0
    empty: int = 0
    undecodable: int = 0
    replaced: int = 0
    long_documents: int = 0  # encoded in pieces (pieces.py)
    hard_cuts: int = 0  # of those pieces, cuts made without a space
    named: dict[str, list[str]] = field(default_factory=dict)  # kind -> the first NAMED files of it

    def note(self, kind: str, path: str) -> None:
        """Count a file skipped (binary, undecodable, empty) or decoded with replacement, by name."""
        if kind != "empty":  # empty documents are counted where they are dropped (Encoder.read)
            setattr(self, kind, getattr(self, kind) + 1)
        names = self.named.setdefault(kind, [])
        if len(names) < NAMED:
            names.append(path)


NAMED = 3  # files named per kind in prepare-data's summary (then a count)


def _row(line: bytes, where: str) -> object:
    try:
        return json.loads(line)
    except ValueError as e:
        raise DataError(f"{where}: not a JSON object ({e})") from None


def _row_text(line: bytes, text_field: str, where: str) -> str:
    row = _row(line, where)
    if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
        what = f"keys: {sorted(row)[:8]}" if isinstance(row, dict) else f"a JSON {type(row).__name__}, not an object"
        raise DataError(f"{where}: no string field {text_field!r} (--text-field); {what}")
    return row[text_field]


class Rendered(str):
    """A conversation rendered with its chat template; `spans`: the characters that count in
    the loss (datasets/chat.py). Everywhere else it is the document's text."""

    spans: list[tuple[int, int]]


class ChatRows:
    """--chat: a .jsonl row -> its conversation, Rendered (picklable; the template compiles lazily)."""

    def __init__(self, template, roles: tuple[str, ...]):
        self.template, self.roles, self._render = template, roles, None

    def __getstate__(self):
        return {"template": self.template, "roles": self.roles, "_render": None}

    def __call__(self, line: bytes, where: str) -> Rendered:
        from .chat import Renderer, conversation_spans, row_messages

        if self._render is None:
            self._render = Renderer(self.template)
        messages = row_messages(_row(line, where), where, self.roles)
        text, spans = conversation_spans(self._render, messages, self.roles, where)
        rendered = Rendered(text)
        rendered.spans = spans
        return rendered


def task_texts(
    task: tuple, text_field: str, chunk: Chunk, decoding: Decoding = UTF8, chat: ChatRows | None = None
) -> list[str | bytes]:
    """The documents of one task, in order; counts bytes and names skipped files in `chunk`.
    With `chat`, every input is a .jsonl of conversations and each row is one, Rendered."""
    kind = task[0]
    if chat is not None and kind != "jsonl":
        where = task[1][0] if kind == "files" else task[1]
        raise DataError(f"--chat: {where!r} is not a .jsonl file; --chat reads .jsonl rows holding 'messages'")
    if chat is not None:
        _, path, first, lines = task
        chunk.bytes_read += sum(len(line) for line in lines)
        return [chat(ln, f"{path}:{first + i}") for i, ln in enumerate(lines) if ln.strip()]
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
                 decoding: Decoding = UTF8, chat: ChatRows | None = None):  # fmt: skip
        from tokenizers import Tokenizer

        from .chat import chat_tokenizer

        self.tok = Tokenizer.from_str(tokenizer_json)
        self.tok.encode_special_tokens = True  # a literal "<|endoftext|>" in a document is text, not EOS
        self.eos, self.dtype = eos_id, np.dtype(dtype)
        self.val_fraction, self.seed, self.text_field, self.decoding = val_fraction, seed, text_field, decoding
        self.chat = chat  # --chat: the template's special tokens are recognised in the rendering
        self.chat_tok = chat_tokenizer(tokenizer_json) if chat is not None else None

    def encode(self, texts: list[str | bytes]) -> list[list[int]] | list[tuple[list[int], np.ndarray]]:
        """The ids of each text (one encode_batch_fast call: the Rust tokenizer's threads); a
        document kept as raw bytes (the byte tokenizer only) is its byte values. With --chat,
        (ids, loss mask) of each conversation."""
        if self.chat is not None:
            from .chat import encode_conversations

            return encode_conversations(self.chat_tok, list(texts), [t.spans for t in texts])
        strings = [t for t in texts if isinstance(t, str) and len(t) <= PIECE]
        encoded = iter(self.tok.encode_batch_fast(strings, add_special_tokens=False) if strings else [])
        return [
            (next(encoded).ids if len(t) <= PIECE else encode_long(self.tok, t, self.dtype))
            if isinstance(t, str)
            else np.frombuffer(t, np.uint8)
            for t in texts
        ]

    def flat(self, ids: list) -> tuple[np.ndarray, np.ndarray]:
        """(the ids with EOS after each document, per-document lengths including the EOS). A
        long document's Pieces are emptied as they are copied (one copy of its ids at a time)."""
        lengths = np.fromiter(((x.total() if isinstance(x, Pieces) else len(x)) + 1 for x in ids), np.int64, len(ids))
        flat = np.empty(int(lengths.sum()), self.dtype)
        ends = np.cumsum(lengths)
        flat[ends - 1] = self.eos
        for start, x in zip((ends - lengths).tolist(), ids):
            if isinstance(x, Pieces):
                while x:
                    part = x.pop(0)
                    flat[start : start + len(part)] = part
                    start += len(part)
            else:
                flat[start : start + len(x)] = x
        return flat, lengths

    def put(self, chunk: Chunk, split: str, encoded: list) -> None:
        """One split's encoded documents into `chunk` (with --chat their masks too: the EOS
        after each conversation does not count)."""
        if self.chat is None:
            chunk.tokens[split], chunk.lengths[split] = self.flat(encoded)
            return
        chunk.tokens[split], chunk.lengths[split] = self.flat([ids for ids, _ in encoded])
        zero = np.zeros(1, np.uint8)
        chunk.masks[split] = np.concatenate([x for _, m in encoded for x in (m, zero)] or [np.zeros(0, np.uint8)])

    def read(self, tasks: list[tuple]) -> tuple[Chunk, dict[str, list[str]]]:
        """The documents of `tasks`, in order, per split; the counts in a fresh Chunk."""
        chunk, split = Chunk(), {"train": [], "val": []}
        for task in tasks:
            texts = task_texts(task, self.text_field, chunk, self.decoding, self.chat)
            kept = [t for t in texts if t]
            chunk.empty += len(texts) - len(kept)
            for text in kept:
                split["val" if in_validation(text, self.val_fraction, self.seed) else "train"].append(text)
        return chunk, split

    def fill(self, chunk: Chunk, split: dict[str, list[str]]) -> Chunk:
        """Encode both splits in one batch and put their token arrays into `chunk`. The texts
        are let go once encoded, before the token arrays are joined (a long document's text
        and its tokens are not held together with their joined copy)."""
        n, texts = len(split["train"]), split.pop("train") + split.pop("val")
        ids = self.encode(texts)
        texts.clear()
        long = [x for x in ids if isinstance(x, Pieces)]
        chunk.long_documents, chunk.hard_cuts = len(long), sum(x.hard for x in long)
        self.put(chunk, "train", ids[:n])
        self.put(chunk, "val", ids[n:])
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
