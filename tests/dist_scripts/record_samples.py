"""Train with every rank recording the samples it reads: `python -m dtensor3d train` with
`make_source` wrapped (in the loop and in the evaluation hook), so each read of training
sample i appends [i, window, tokens] to OUT/rank<R>.jsonl and each read of validation sample
j appends [j, j, tokens] to OUT_validation/rank<R>.jsonl (in the order read). A mixture's
window is [source name, window]. The wrapper keeps the source's attributes (windows, epoch,
source_of), so the loop behaves as without it.

usage: torchrun ... record_samples.py OUT train RECIPE [key=value ...]
"""

import json
import os
import sys

import torch.distributed as dist

from dtensor3d.__main__ import main
from dtensor3d.training import hooks, train


class Recorded:
    """A source whose reads are appended to a file."""

    def __init__(self, source, out: str, split: str):
        self.source, self.out, self.split = source, out, split

    def __getattr__(self, name):
        return getattr(self.source, name)

    def __call__(self, i: int):
        sample = self.source(i)
        window = self.source.window(i) if self.split == "train" else i
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, f"rank{dist.get_rank()}.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps([i, window, sample.tolist()]) + "\n")
        return sample


def recording(make_source, out: str):
    def make(recipe, split: str = "train"):
        return Recorded(make_source(recipe, split), out if split == "train" else f"{out}_validation", split)

    return make


if __name__ == "__main__":
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    train.make_source = recording(train.make_source, out)
    hooks.make_source = recording(hooks.make_source, out)
    sys.exit(main(sys.argv[2:]))
