"""Data parallelism over the flattened dp x cp mesh: FSDP2 (`shard`) or all-reduce (`replicate`).

The loss of every rank is already normalised by the token count of the whole global batch,
so gradients are *summed* over the data-parallel ranks, never averaged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from .shards import local


def apply_fsdp(
    model: nn.Module,
    dp_mesh,
    expert_mesh=None,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
) -> nn.Module:
    """fully_shard each MoE layer's experts over `expert_mesh` (dp x cp: they are already
    split over ep), each decoder block and then the root (embedding, final norm, head) over
    `dp_mesh` (ep x dp x cp for the dense parameters, which ep replicates)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.model.layers.values():
        moe = getattr(block, "block_sparse_moe", None)
        if moe is not None:
            fully_shard(moe.experts, mesh=expert_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return model


def allreduce_grads(params: list[nn.Parameter], group) -> None:
    """DDP-style gradient sum over `group`, one coalesced buffer per dtype."""
    if dist.get_world_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            g = local(p.grad)
            by_dtype.setdefault(g.dtype, []).append(g)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def sample_indices(recipe, step: int, batch_rank: int, batch_ranks: int) -> list[int]:
    """Global sample indices of one rank's local batch (all its microbatches, in order)."""
    t = recipe.training
    mbs, per_micro = t.micro_batch_size, t.micro_batch_size * batch_ranks
    base = step * t.global_batch_size
    n_micro = t.global_batch_size // per_micro
    return [base + m * per_micro + batch_rank * mbs + j for m in range(n_micro) for j in range(mbs)]


def local_batch(recipe, source, step: int, batch_rank: int = 0, batch_ranks: int = 1):
    """(inputs, targets), each [n_microbatches * micro_batch_size, sequence_length]."""
    rows = torch.stack([source(i) for i in sample_indices(recipe, step, batch_rank, batch_ranks)])
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
