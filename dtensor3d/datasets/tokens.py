"""Reading a prepared directory (tokendir.py): token streams, training windows in a seeded
order, and the fixed validation windows.

Training (`TrainWindows`): the training stream of N tokens holds W = (N - 1) // L windows
of L + 1 tokens (L = sequence_length), window w being tokens [w * L, w * L + L], so
consecutive windows share one token (the last target of one is the first input of the
next). Sample i of the run is window perm_e(i mod W) of epoch e = i // W, where perm_e is a
bijection of 0..W-1 keyed by (seed, e): a 4-round Feistel network on the smallest even
number of bits covering W, cycle-walked back into 0..W-1 (apply it again while the value is
>= W; a bijection on the larger domain restricted this way is a bijection on 0..W-1, and it
takes fewer than 4 applications on average). No permutation array exists, so a corpus of a
trillion tokens costs no memory, and sample i depends on (seed, i) alone: never on the mesh,
the rank, or the samples drawn before it. Each epoch gets a fresh permutation.

Validation (`ValidationWindows`): the validation stream's windows in order, 0..count-1,
the same fixed list at every mesh.

Loss masks (a directory prepare-data --chat wrote): both kinds of windows are `masked` and
`loss_mask(i)` gives the uint8 mask of sample i's L + 1 tokens (1: the token counts in the
loss as a target), read from the mask files beside the shards at the same positions.

Documents (data.document_masking): `documents(i)` gives each token of window i its position
within its document and its document's number within the window (`window_documents`, from
the split's document offsets). A window that begins inside a document treats that part as a
document of its own (positions from 0): a token only ever sees tokens of its window.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..errors import DataError
from .tokendir import docs_name, mask_name, read_meta, window_count  # noqa: F401 (window_count: re-exported)

MASK64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """splitmix64's finalizer: a bijective 64-bit mixer."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


class FeistelPermutation:
    """A keyed bijection of 0..n-1 (see the module docstring); `perm(j)` is O(1) memory."""

    ROUNDS = 4

    def __init__(self, n: int, seed: int, epoch: int):
        if n < 1:
            raise ValueError(f"a permutation of {n} elements")
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)  # 2 * half bits cover 0..n-1
        self.mask = (1 << self.half) - 1
        base = mix64((seed & MASK64) ^ mix64(epoch))
        self.keys = [mix64(base + r) for r in range(self.ROUNDS)]

    def _once(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (mix64(right ^ key) & self.mask)
        return (left << self.half) | right

    def __call__(self, j: int) -> int:
        if not 0 <= j < self.n:
            raise IndexError(f"{j} is outside 0..{self.n - 1}")
        x = self._once(j)
        while x >= self.n:
            x = self._once(x)
        return x


def window_documents(offsets: np.ndarray, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, document ids), each int64 [length], of stream tokens [start, start + length):
    a token's position counts from its document's first token or from `start`, whichever is
    later (Hugging Face's position_ids of packed sequences); ids number the window's documents
    from 0. `offsets`: the split's document offsets (tokendir.py), 0 first, the token count last."""
    index = np.arange(start, start + length, dtype=np.int64)
    doc = np.searchsorted(offsets, index, side="right") - 1  # the document of each token
    first = np.maximum(np.asarray(offsets[doc], dtype=np.int64), start)
    return torch.from_numpy(index - first), torch.from_numpy(doc - doc[0])


class TokenStream:
    """One split of a prepared directory: its shards as one memory-mapped token stream, and
    its document offsets (memory-mapped when first asked for)."""

    def __init__(self, path: str, meta: dict, split: str):
        entry = meta["splits"][split]
        self.docs_file = os.path.join(path, entry.get("docs", docs_name(split)))
        self._offsets = None
        dtype = np.dtype(meta["dtype"]).newbyteorder("<")
        self.shards = [_memmap(path, s["file"], dtype, s["tokens"]) for s in entry["shards"]]
        self.masked = "loss_mask" in meta
        shards = entry["shards"] if self.masked else []
        self.masks = [_memmap(path, mask_name(s["file"]), np.uint8, s["tokens"]) for s in shards]
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])
        self.tokens = int(self.starts[-1])

    def read(self, start: int, length: int, masks: bool = False) -> np.ndarray:
        """Tokens [start, start + length) as int64, across shard boundaries (with `masks`:
        their loss mask, uint8)."""
        if start < 0 or start + length > self.tokens:
            raise IndexError(f"tokens [{start}, {start + length}) outside 0..{self.tokens}")
        files = self.masks if masks else self.shards
        out, k = [], int(np.searchsorted(self.starts, start, side="right")) - 1
        while length > 0:
            offset = start - int(self.starts[k])
            part = files[k][offset : offset + length]
            out.append(np.array(part, dtype=np.uint8) if masks else np.asarray(part, dtype=np.int64))
            start, length, k = start + len(part), length - len(part), k + 1
        return np.concatenate(out) if len(out) > 1 else out[0]

    def documents(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """window_documents of tokens [start, start + length)."""
        if self._offsets is None:
            self._offsets = np.memmap(self.docs_file, dtype="<i8", mode="r")
        return window_documents(self._offsets, start, length)


def _memmap(path: str, name: str, dtype, tokens: int) -> np.ndarray:
    """A shard (or its mask) memory-mapped; an empty one as an empty array."""
    return np.memmap(os.path.join(path, name), dtype=dtype, mode="r") if tokens else np.zeros(0, dtype)


class TrainWindows:
    """sample(i) -> int64 tensor of L + 1 tokens: window perm_{i // W}(i mod W) (module docstring)."""

    def __init__(self, path: str, sequence_length: int, seed: int, meta: dict | None = None):
        self.stream = TokenStream(path, meta or read_meta(path), "train")
        self.length, self.seed = sequence_length, seed
        self.windows = window_count(self.stream.tokens, sequence_length)
        if self.windows < 1:
            raise DataError(f"data.path {path!r}: {self.stream.tokens} training tokens, fewer than one sample")
        self._perm, self._perm_epoch = None, -1

    def epoch(self, i: int) -> int:
        return i // self.windows

    def window(self, i: int) -> int:
        """Which window sample i is."""
        e = self.epoch(i)
        if self._perm_epoch != e:  # a cache of the key schedule only
            self._perm, self._perm_epoch = FeistelPermutation(self.windows, self.seed, e), e
        return self._perm(i % self.windows)

    @property
    def masked(self) -> bool:
        return self.stream.masked

    def __call__(self, i: int) -> torch.Tensor:
        start = self.window(i) * self.length
        return torch.from_numpy(self.stream.read(start, self.length + 1))

    def loss_mask(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.stream.read(self.window(i) * self.length, self.length + 1, masks=True))

    def documents(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, document ids) [L + 1] of sample i's tokens (module docstring)."""
        return self.stream.documents(self.window(i) * self.length, self.length + 1)


class ValidationWindows:
    """The fixed validation windows: sample(j) is window j mod count, in stream order."""

    def __init__(self, path: str, split: str, sequence_length: int, meta: dict | None = None):
        self.stream = TokenStream(path, meta or read_meta(path), split)
        self.length = sequence_length
        self.count = window_count(self.stream.tokens, sequence_length)
        if self.count < 1:
            raise DataError(
                f"data.validation: {path!r} split {split!r} has {self.stream.tokens} tokens, fewer than one "
                f"sample of {sequence_length + 1}"
            )

    @property
    def masked(self) -> bool:
        return self.stream.masked

    def __call__(self, j: int) -> torch.Tensor:
        start = (j % self.count) * self.length
        return torch.from_numpy(self.stream.read(start, self.length + 1))

    def loss_mask(self, j: int) -> torch.Tensor:
        return torch.from_numpy(self.stream.read((j % self.count) * self.length, self.length + 1, masks=True))

    def documents(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, document ids) [L + 1] of sample j's tokens (module docstring)."""
        return self.stream.documents((j % self.count) * self.length, self.length + 1)
