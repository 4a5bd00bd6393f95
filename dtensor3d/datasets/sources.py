"""Token sources: `make_source(recipe)` returns sample(i) -> the i-th training sample.

Sample `i` of the run is a pure function of (seed, i), never of the mesh: step `s` uses
samples [s * global_batch_size, (s + 1) * global_batch_size). Which rank takes which of
them is data parallelism's business (parallel/data.py).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..errors import DataError


def synthetic_sample(seed: int, index: int, length: int, vocab_size: int) -> torch.Tensor:
    """A learnable token sequence: an arithmetic progression mod vocab with a random start
    and stride, so a model that reads its context can drive the loss down."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    start = int(torch.randint(vocab_size, (1,), generator=g))
    stride = int(torch.randint(1, 5, (1,), generator=g))
    return (start + stride * torch.arange(length)) % vocab_size


class TokenFile:
    """A flat file of token ids (.npy of any integer dtype, or nanoGPT's uint16 .bin),
    memory-mapped; sample i is window i mod W of its W = tokens.window_count windows of L + 1
    tokens (window w: tokens [w * L, w * L + L]), in file order."""

    def __init__(self, path: str, sequence_length: int):
        from .tokens import window_count

        self.tokens = (
            np.load(path, mmap_mode="r") if path.endswith(".npy") else np.memmap(path, dtype=np.uint16, mode="r")
        )
        self.length, self.windows = sequence_length, window_count(len(self.tokens), sequence_length)
        if self.windows < 1:  # the door refuses such a file first
            raise DataError(f"data.path {path!r}: {len(self.tokens)} tokens, fewer than one sample")

    def sample(self, index: int) -> torch.Tensor:
        start = (index % self.windows) * self.length
        return torch.from_numpy(np.asarray(self.tokens[start : start + self.length + 1], dtype=np.int64))


# Synthetic validation samples come from their own seed stream, disjoint from training's.
SYNTHETIC_VALIDATION_SEED = 1_000_000_007


def data_seed(recipe) -> int:
    """The seed of the sample order: data.seed, else training.seed."""
    return recipe.training.seed if recipe.data.seed is None else recipe.data.seed


def prepared_source(recipe, split: str):
    """A prepared directory (datasets/tokens.py) or a mixture of them (data.sources /
    data.stages: datasets/mixture.py). "train": seeded windows, a fresh permutation each
    epoch. "validation": the fixed windows of data.validation ("split": data.path's own
    validation split, or every mixture source's, source after source; a directory: that
    prepared directory's validation split, or its training split when it has no validation
    part), window j mod their count."""
    from ..config.data_sources import unique_sources
    from .mixture import Mixture, MixtureValidation
    from .tokens import TrainWindows, ValidationWindows, read_meta

    d, length = recipe.data, recipe.training.sequence_length
    mixed = d.sources is not None or d.stages is not None
    if split == "train" and mixed:
        return Mixture(d, length, recipe.training.global_batch_size, data_seed(recipe))
    if split == "train":
        return TrainWindows(d.path, length, data_seed(recipe))
    if d.validation is None:
        raise DataError("data.validation is null: no validation windows; set training.eval_every: 0 or give one")
    if mixed and d.validation == "split":
        return MixtureValidation([s for _, s in unique_sources(d)], length)
    path = d.path if d.validation == "split" else d.validation
    meta = read_meta(path)
    part = "val" if d.validation == "split" or meta["splits"]["val"]["tokens"] > length else "train"
    return ValidationWindows(path, part, length, meta)


def make_source(recipe, split: str = "train"):
    """sample(index) -> int64 tensor of sequence_length + 1 tokens, of the "train" or the
    "validation" split."""
    t, d = recipe.training, recipe.data
    length = t.sequence_length + 1
    if d.kind == "tokens" and (d.path is None or os.path.isdir(d.path)):
        return prepared_source(recipe, split)
    if d.kind == "tokens":
        if split != "train":
            raise DataError(
                f"data.path={d.path!r}: a single token file has no validation split; set training.eval_every: 0"
            )
        return TokenFile(d.path, t.sequence_length).sample
    seed = data_seed(recipe) + (SYNTHETIC_VALIDATION_SEED if split == "validation" else 0)
    return lambda i: synthetic_sample(seed, i, length, recipe.model.vocab_size)


def epoch_note(source, recipe, step: int) -> str | None:
    """The line announcing each epoch of the sample order (beyond the first) whose first
    sample is in global batch `step`; None when there is none, or the source has no epochs
    (only a prepared directory's TrainWindows do). Rank 0 prints it."""
    windows = getattr(source, "windows", None)
    if windows is None:
        return None
    size = recipe.training.global_batch_size
    first, last = step * size, (step + 1) * size - 1
    lines = [
        f"data: epoch {e} begins at sample {e * windows} (step {step + 1}): a fresh permutation of the {windows} "
        f"training windows (data.seed {data_seed(recipe)})"
        for e in range(max(1, -(-first // windows)), last // windows + 1)
    ]
    return "\n".join(lines) or None


def data_position(recipe, step: int) -> dict:
    """The data's part of a checkpoint record: which source, in which order, how far it is read
    (sample i of a run is a pure function of the seed and i, so this is the whole position)."""
    d = recipe.data
    mixture = {} if d.sources is None and d.stages is None else recipe.to_dict()["data"]
    return {
        "kind": recipe.data.kind,
        "path": recipe.data.path,
        **{key: mixture[key] for key in ("sources", "stages") if mixture},
        "seed": recipe.training.seed,
        "samples_consumed": step * recipe.training.global_batch_size,
    }
