"""`parallelism.fsdp_reshard_after_forward: auto` decided at the start of a run, on this
device: plan/reshard.py's rule with the device's memory (CUDA: the GPU's; CPU: this machine's
available RAM over its local ranks), decided on rank 0 and broadcast so every rank builds
the same FSDP units; rank 0 prints the choice among the run's first lines."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..errors import is_rank0
from ..plan.estimate import resolve_reshard
from ..plan.reshard import cpu_bytes, local_ranks


def device_bytes(recipe, device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return cpu_bytes(local_ranks(recipe))


def decide_reshard(recipe, device: torch.device):
    """The recipe with `auto` decided (unchanged where the key is not auto)."""
    p = recipe.parallelism
    if p.fsdp_reshard_after_forward != "auto":
        return recipe
    choice = [None]
    if dist.get_rank() == 0:
        decided, line = resolve_reshard(recipe, device_bytes(recipe, device))
        q = decided.parallelism
        choice = [(q.fsdp_reshard_after_forward, q.fsdp_bucket_layers, line)]
    dist.broadcast_object_list(choice, src=0, device=device if device.type == "cuda" else None)
    policy, bucket, line = choice[0]
    if line and is_rank0():
        print(line, flush=True)
    changed = dataclasses.replace(p, fsdp_reshard_after_forward=policy, fsdp_bucket_layers=bucket)
    return dataclasses.replace(recipe, parallelism=changed)
