"""The training loop as train.py runs it, with StepProfiler wired the way dtensor3d/profiling.py
asks, until the lead wires it into train.train: trains the recipe and writes
<run_dir>/profile/trace_rank<R>.json for logging.profile_steps."""

import os
import sys

import torch.distributed as dist

from dtensor3d.datasets.sources import make_source
from dtensor3d.profiling import StepProfiler
from dtensor3d.recipe import load_recipe
from dtensor3d.train import rank_batch, setup, train_step

recipe_path, *overrides = sys.argv[1:]
recipe = load_recipe(recipe_path, overrides, world_size=int(os.environ["WORLD_SIZE"]))
state = setup(recipe)
source = make_source(recipe)
profiler = StepProfiler(recipe.logging.profile_steps, recipe.logging.run_dir, dist.get_rank(), state.device)
try:
    while state.step < recipe.training.steps:
        with profiler.step(state.step + 1):
            train_step(state, rank_batch(state, source, state.step))
finally:
    profiler.close()
dist.barrier()
dist.destroy_process_group()
