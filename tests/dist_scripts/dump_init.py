"""Build a run's model at the mesh given by the overrides and write the full (gathered)
initial weights of this rank's pipeline stage to OUT/rank<R>.safetensors."""

import os
import sys

import torch.distributed as dist
from safetensors.torch import save_file

from dtensor3d.config.load import load_recipe
from dtensor3d.training.train import setup

out, recipe_path, *overrides = sys.argv[1:]
recipe = load_recipe(recipe_path, overrides, world_size=int(os.environ["WORLD_SIZE"]))
state = setup(recipe)
full = {}
for name, p in state.model.named_parameters():
    full[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().contiguous()
if state.coords["dp"] == 0 and state.coords["tp"] == 0:
    save_file(full, os.path.join(out, f"rank{dist.get_rank()}.safetensors"))
dist.barrier()
dist.destroy_process_group()
