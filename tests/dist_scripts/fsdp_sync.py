"""Count FSDP2's gradient reduce-scatters per optimizer step by wrapping the collective it
calls (torch.distributed.reduce_scatter_single); print one JSON line from rank 0:
{"per_step": [calls in step 1, step 2], "units": FSDP units, "microbatches": m}."""

import json
import os
import sys

import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from dtensor3d.config.load import load_recipe
from dtensor3d.datasets.sources import make_source
from dtensor3d.training.train import rank_batch, setup, train_step

recipe_path, *overrides = sys.argv[1:]
recipe = load_recipe(recipe_path, overrides, world_size=int(os.environ["WORLD_SIZE"]))
state = setup(recipe)
calls = []
real = dist.reduce_scatter_single


def counting(*args, **kwargs):
    calls.append(1)
    return real(*args, **kwargs)


dist.reduce_scatter_single = counting
source, per_step = make_source(recipe), []
for step in range(2):
    before = len(calls)
    train_step(state, rank_batch(state, source, step))
    per_step.append(len(calls) - before)
units = sum(isinstance(m, FSDPModule) for m in state.model.modules())
if dist.get_rank() == 0:
    print(json.dumps({"per_step": per_step, "units": units, "microbatches": recipe.num_microbatches}), flush=True)
dist.barrier()
dist.destroy_process_group()
