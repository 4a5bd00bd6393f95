"""A weighted mixture of prepared directories, switched at steps: sample i of the run as a
pure function of (seed, i), like one directory's (tokens.py), so a resume on any mesh reads
the same samples.

The schedule. Each mixture (data.sources, then each of data.stages) covers the samples of its
steps: stage g, beginning at 1-based step S_g, owns samples from (S_g - 1) * global_batch_size
on. Its weights become integers c_k in their exact proportion where a block of at most
1,000,000 samples holds it (0.7 / 0.2 / 0.1 -> 7 / 2 / 1, 0.0001 / 0.9999 -> 1 / 9999), else
in the smallest block found that honours every weight to 0.1% (config/mixture_weights.py:
every positive weight gets at least one sample of each block); a block is B = sum(c_k)
consecutive samples, and in every block source k takes exactly c_k of them. Sample j of the
stage (j counted from its first) sits at offset o = j mod B of block b = j // B; its slot is
perm_{g,b}(o), a keyed bijection of 0..B-1 (tokens.FeistelPermutation keyed by the seed, the
stage and b); slot s in [C_k, C_k + c_k) (C_k = c_0 + ... + c_{k-1}) picks source k and is
that source's draw b * c_k + (s - C_k) of the stage: every draw of a block used exactly once.

Within a source, draw d (counted over the whole run: a stage continues the draws of the
stages before it, from the first whole block after them) is sample d of that directory's
own `TrainWindows`, seeded by the data seed and the source's name: its windows in a fresh
permutation each epoch. A source is known by its name in every stage.
"""

from __future__ import annotations

import os
import zlib

import torch

from ..config.data_sources import Source, mixtures_of
from ..config.mixture_weights import integer_weights, weights_problem
from ..errors import DataError
from .tokendir import read_meta
from .tokens import FeistelPermutation, TrainWindows, ValidationWindows, mix64, window_count


def block_counts(where: str, sources) -> list[int]:
    """Each source's samples per block (config/mixture_weights.py); the door refuses weights
    it cannot honour, so the DataError here is for a caller that skipped the door."""
    counts = integer_weights([s.weight for s in sources])
    if counts is None:
        raise DataError(weights_problem(where, sources))
    return counts


def source_seed(seed: int, name: str) -> int:
    """The seed of one source's own window order: the data seed and the name (not its position)."""
    return mix64((seed & (2**64 - 1)) ^ mix64(zlib.crc32(name.encode())))


class Mixture:
    """sample(i) -> int64 tensor of L + 1 tokens (module docstring); `source_of(i)` the index
    of its source in `names`, `window(i)` (name, window) for the record."""

    def __init__(self, data, sequence_length: int, global_batch_size: int, seed: int):
        mixtures = mixtures_of(data)
        starts = [1] if data.path is not None or data.sources is not None else []
        starts += [stage.start_step for stage in data.stages or ()]
        self.first_sample = [(s - 1) * global_batch_size for s in starts]
        self.stages = [sources for _, sources in mixtures]
        self.counts = [block_counts(where, sources) for where, sources in mixtures]
        self.names: list[str] = []
        self.readers: dict[str, TrainWindows] = {}
        for sources in self.stages:
            for s in sources:
                if s.name not in self.readers:
                    self.names.append(s.name)
                    self.readers[s.name] = TrainWindows(s.path, sequence_length, source_seed(seed, s.name))
        self.seed, self.offsets = seed, self._draw_offsets()
        self._perm_key, self._perm = None, None

    def _draw_offsets(self) -> list[dict[str, int]]:
        """Per stage, each source's first draw: the draws of the whole blocks before it (a
        partial last block counts whole, so no draw is used twice)."""
        offsets, used = [], dict.fromkeys(self.names, 0)
        for g, sources in enumerate(self.stages):
            offsets.append({s.name: used[s.name] for s in sources})
            if g + 1 < len(self.stages):
                blocks = -(-(self.first_sample[g + 1] - self.first_sample[g]) // sum(self.counts[g]))
                for s, c in zip(sources, self.counts[g]):
                    used[s.name] += blocks * c
        return offsets

    def stage(self, i: int) -> int:
        """Which mixture sample i comes from (the last one begun by its step)."""
        return max(g for g, first in enumerate(self.first_sample) if first <= i)

    def pick(self, i: int) -> tuple[Source, int]:
        """(the source of sample i, its draw of that source)."""
        g = self.stage(i)
        counts = self.counts[g]
        b, o = divmod(i - self.first_sample[g], sum(counts))
        if self._perm_key != (g, b):  # a cache of the key schedule only
            self._perm_key, self._perm = (g, b), FeistelPermutation(sum(counts), mix64(self.seed) ^ g, b)
        slot = self._perm(o)
        for source, c in zip(self.stages[g], counts):
            if slot < c:
                return source, self.offsets[g][source.name] + b * c + slot
            slot -= c
        raise AssertionError("a slot beyond the block")

    def source_of(self, i: int) -> int:
        return self.names.index(self.pick(i)[0].name)

    def window(self, i: int) -> tuple[str, int]:
        source, draw = self.pick(i)
        return source.name, self.readers[source.name].window(draw)

    def __call__(self, i: int) -> torch.Tensor:
        source, draw = self.pick(i)
        return self.readers[source.name](draw)

    @property
    def masked(self) -> bool:
        """Some source has loss masks (prepare-data --chat); the others' tokens all count."""
        return any(r.masked for r in self.readers.values())

    def loss_mask(self, i: int) -> torch.Tensor:
        source, draw = self.pick(i)
        return part_mask(self.readers[source.name], draw)

    def documents(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, document ids) of sample i's tokens, from its source (data.document_masking)."""
        source, draw = self.pick(i)
        return self.readers[source.name].documents(draw)


def part_mask(reader, j: int) -> torch.Tensor:
    """One source's loss mask of its sample j: its own, or all ones where it has none."""
    return reader.loss_mask(j) if reader.masked else torch.ones(reader.length + 1, dtype=torch.uint8)


class MixtureValidation:
    """The validation windows of a mixture: each source's held-out windows (data.validation
    split), source after source in `names` order; sample(j) is window j mod their count."""

    def __init__(self, mixture_sources: list[Source], sequence_length: int):
        self.parts = []
        for s in mixture_sources:
            meta = read_meta(s.path)
            if window_count(meta["splits"]["val"]["tokens"], sequence_length) >= 1:
                self.parts.append(ValidationWindows(s.path, "val", sequence_length, meta))
        self.count = sum(p.count for p in self.parts)
        if self.count < 1:
            names = ", ".join(os.path.normpath(s.path) for s in mixture_sources)
            raise DataError(f"data.validation: split, but no source ({names}) has a validation window")

    def _find(self, j: int):
        j %= self.count
        for part in self.parts:
            if j < part.count:
                return part, j
            j -= part.count
        raise AssertionError("a window beyond the count")

    def __call__(self, j: int) -> torch.Tensor:
        part, k = self._find(j)
        return part(k)

    @property
    def masked(self) -> bool:
        return any(p.masked for p in self.parts)

    def loss_mask(self, j: int) -> torch.Tensor:
        return part_mask(*self._find(j))

    def documents(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        part, k = self._find(j)
        return part.documents(k)
