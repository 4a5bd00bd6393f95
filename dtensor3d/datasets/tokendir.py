"""The on-disk form of a prepared directory, written by prepare-data and read by tokens.py.

    DIR/meta.json              what is below, the tokenizer, the counts, and the size and sha256 of
                               every file beside it (shards, masks, offsets: "docs_sha256";
                               tokenizer.json and the chat template: "files")
    DIR/tokenizer.json         the Hugging Face tokenizer the ids come from
    DIR/train_00000.bin ...    flat token ids, little-endian uint16 (vocabulary <= 65536) or uint32
    DIR/train_docs.bin         int64 document offsets into the split's stream: n_documents + 1
                               entries, 0 first; document k is tokens [off[k], off[k+1]), its EOS last
    DIR/val_00000.bin, val_docs.bin   the same for the validation split
    DIR/train_00000.mask ...   (prepare-data --chat) one uint8 per token of the shard beside it:
                               1 where the token counts in the loss as a target; meta.json's
                               "loss_mask" names the roles counted, each shard entry its "mask"
    DIR/chat_template.jinja    (--chat) the template the conversations were rendered with

Each split is one stream: its shards concatenated in order. Everything is raw little-endian
arrays (memory-mappable, nothing to unpickle).
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from ..errors import DataError

SPLITS = ("train", "val")
META = "meta.json"
TOKENIZER = "tokenizer.json"


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:05d}.bin"


def mask_name(shard: str) -> str:
    """The loss-mask file beside a token shard: train_00000.bin -> train_00000.mask."""
    return shard[: -len(".bin")] + ".mask"


def docs_name(split: str) -> str:
    return f"{split}_docs.bin"


class ShardWriter:
    """Appends token arrays to one split's shards (at most `shard_tokens` each) and its
    document offsets, hashing as it writes; `close()` returns the split's meta entry."""

    def __init__(self, folder: str, split: str, dtype: str, shard_tokens: int, masked: bool = False):
        self.folder, self.split, self.dtype, self.limit = folder, split, np.dtype(dtype), shard_tokens
        self.shards: list[dict] = []
        self.file, self.hash, self.in_shard = None, None, 0
        self.masked, self.mask_file, self.mask_hash = masked, None, None
        self.tokens = self.documents = 0
        self.docs, self.docs_hash = open(os.path.join(folder, docs_name(split)), "wb"), hashlib.sha256()
        self._write_offsets(np.zeros(1, "<i8"))

    def _finish_shard(self) -> None:
        if self.file is not None:
            self.file.close()
            name = shard_name(self.split, len(self.shards))
            self.shards.append({"file": name, "tokens": self.in_shard, "bytes": self.in_shard * self.dtype.itemsize})
            self.shards[-1]["sha256"] = self.hash.hexdigest()
            if self.masked:
                self.mask_file.close()
                self.shards[-1].update(mask=mask_name(name), mask_sha256=self.mask_hash.hexdigest())
        self.file, self.hash, self.in_shard = None, None, 0

    def _open_shard(self) -> None:
        name = shard_name(self.split, len(self.shards))
        self.file, self.hash = open(os.path.join(self.folder, name), "wb"), hashlib.sha256()
        if self.masked:
            self.mask_file, self.mask_hash = open(os.path.join(self.folder, mask_name(name)), "wb"), hashlib.sha256()

    def _write_tokens(self, tokens: np.ndarray, mask: np.ndarray | None) -> None:
        data = tokens.astype(self.dtype.newbyteorder("<"), copy=False)
        while len(data):
            if self.file is None:
                self._open_shard()
            part = data[: self.limit - self.in_shard]
            view = memoryview(np.ascontiguousarray(part)).cast("B")  # no copy of a long document's tokens
            for file, digest, raw in [(self.file, self.hash, view)] + (
                [(self.mask_file, self.mask_hash, mask[: len(part)].astype(np.uint8).tobytes())] if self.masked else []
            ):
                file.write(raw)
                digest.update(raw)
            self.in_shard += len(part)
            data, mask = data[len(part) :], mask[len(part) :] if self.masked else None
            if self.in_shard == self.limit:
                self._finish_shard()

    def write(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None = None) -> None:
        if self.masked and (mask is None or len(mask) != len(tokens)):
            raise ValueError(f"a loss mask of {None if mask is None else len(mask)} entries for {len(tokens)} tokens")
        self._write_tokens(tokens, mask)
        self._write_offsets((self.tokens + np.cumsum(lengths)).astype("<i8"))
        self.tokens += len(tokens)
        self.documents += len(lengths)

    def _write_offsets(self, offsets: np.ndarray) -> None:
        raw = offsets.tobytes()
        self.docs.write(raw)
        self.docs_hash.update(raw)

    def close(self) -> dict:
        self._finish_shard()
        self.docs.close()
        return {
            "documents": self.documents,
            "tokens": self.tokens,
            "docs": docs_name(self.split),
            "docs_sha256": self.docs_hash.hexdigest(),
            "shards": self.shards,
        }


def read_meta(path: str) -> dict:
    """meta.json of a prepared directory; a missing or unreadable one is a DataError."""
    file = os.path.join(path, META)
    if not os.path.isfile(file):
        raise DataError(f"data.path {path!r}: no {META}; prepare the directory with python -m dtensor3d prepare-data")
    try:
        with open(file, encoding="utf-8") as f:
            meta = json.load(f)
        for key in ("vocab_size", "dtype", "splits"):
            meta[key]  # noqa: B018 (presence)
        for split in ("train", "val"):
            meta["splits"][split]["shards"], meta["splits"][split]["tokens"]  # noqa: B018
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{file}: unreadable ({type(e).__name__}: {e}); prepare the directory again") from None
    return meta


def window_count(tokens: int, sequence_length: int) -> int:
    """The samples a stream of `tokens` tokens holds: windows of L + 1 tokens, window w being
    tokens [w * L, w * L + L] (consecutive windows share one token), so (tokens - 1) // L; one
    sample needs L + 1 tokens. The one definition the door (door.py, which must not import torch)
    and every reader (tokens.py, sources.TokenFile) use."""
    return max(0, (tokens - 1) // sequence_length)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()
