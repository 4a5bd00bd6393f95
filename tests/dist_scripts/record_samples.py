"""Train with every rank recording the training samples it reads: `python -m dtensor3d
train` with `dtensor3d.training.train.make_source` wrapped, so each read of sample i appends
[i, window, tokens] to OUT/rank<R>.jsonl (in the order read). Validation reads are not
recorded. The wrapper keeps the source's attributes (windows, epoch), so the loop behaves
as without it.

usage: torchrun ... record_samples.py OUT train RECIPE [key=value ...]
"""

import json
import os
import sys

import torch.distributed as dist

from dtensor3d.__main__ import main
from dtensor3d.training import train


class Recorded:
    """A training source whose reads are appended to a file."""

    def __init__(self, source, out: str):
        self.source, self.out = source, out

    def __getattr__(self, name):
        return getattr(self.source, name)

    def __call__(self, i: int):
        sample = self.source(i)
        with open(os.path.join(self.out, f"rank{dist.get_rank()}.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps([i, self.source.window(i), sample.tolist()]) + "\n")
        return sample


def recording(make_source, out: str):
    def make(recipe, split: str = "train"):
        source = make_source(recipe, split)
        return Recorded(source, out) if split == "train" else source

    return make


if __name__ == "__main__":
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    train.make_source = recording(train.make_source, out)
    sys.exit(main(sys.argv[2:]))
