"""Data parallelism over the flattened dp x cp mesh (and ep x dp x cp for the parameters ep
replicates): FSDP2 (`dp_mode: shard`) or a gradient all-reduce (`dp_mode: replicate`).

Build time: `apply_fsdp` (FSDP2; HSDP for `dp_mode: hybrid`). Step time: which samples
this rank takes (`rank_samples`), when FSDP may reduce-scatter (`gradient_sync`), and the
all-reduce of `replicate` (`sync_replicated_grads`).

The loss of every rank is already normalised by the token count of the whole global batch,
so gradients are *summed* over the data-parallel ranks, never averaged.

Sample `i` of the run is a pure function of (seed, i) (datasets/). Within step `s`,
microbatch `m` of the rank at batch coordinate `r` (r = ep_rank * dp + dp_rank) holds
samples s * global_batch_size + m * (dp * ep * mbs) + r * mbs + [0, mbs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from ..mesh import mesh_axis
from .expert import expert_params
from .shards import local


def fsdp_policy(device_type: str, dtype: str) -> MixedPrecisionPolicy:
    """FSDP2's mixed-precision policy for training.dtype (pure; the one switch for CPU and
    CUDA): bfloat16 gathers bf16 parameters and so computes in bf16 (the fp32 shards stay the
    master weights), float32 casts nothing; gradients are reduced in fp32 either way. The
    device does not change it (gloo and NCCL get the same policy); a device branch would
    show here and in its test."""
    del device_type  # no device-specific policy
    param_dtype = torch.bfloat16 if dtype == "bfloat16" else None
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def apply_fsdp(model: nn.Module, mesh, parallelism, policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """fully_shard each MoE layer's experts over dp x cp (they are already split over ep),
    the decoder blocks in units of `fsdp_bucket_layers` consecutive blocks, and then the root
    (embedding, final norm, head) over ep x dp x cp (the dense parameters, which ep replicates).

    Args:
        model: this rank's model part, after tp / ep.
        mesh: the mesh from `build_mesh`.
        parallelism: its `reshard_after_forward` decides resharding (a pipeline stage, or
            `fsdp_reshard_after_forward: never`, keeps its parameters gathered for the step).
        policy: `fsdp_policy(device, training.dtype)` (None: fp32's, nothing cast).
    """
    dense_mesh, expert_mesh = fsdp_meshes(mesh, parallelism)
    mp = policy or fsdp_policy(mesh.device_type, "float32")
    kwargs = dict(reshard_after_forward=parallelism.reshard_after_forward, mp_policy=mp)
    blocks, n = list(model.model.layers.values()), parallelism.fsdp_bucket_layers
    blocks += list((getattr(model.model, "mtp", None) or {}).values())  # MTP blocks (models/mtp.py): last units
    for block in blocks:
        moe = getattr(block, "block_sparse_moe", None)
        if moe is not None:
            fully_shard(moe.experts, mesh=expert_mesh, **kwargs)
    for start in range(0, len(blocks), n):
        unit = blocks[start : start + n]
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=dense_mesh, **kwargs)
    fully_shard(model, mesh=dense_mesh, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return model


def fsdp_meshes(mesh, parallelism):
    """(dense, experts) meshes for fully_shard: 1-D (shard) for dp_mode shard; 2-D
    (dp_replicate, shard) for hybrid, which FSDP2 treats as HSDP."""
    if not parallelism.hsdp_enabled:
        return mesh_axis(mesh, "ep_dp_cp"), mesh_axis(mesh, "dp_cp")
    for view in ("ep_dp_shard_cp", "dp_shard_cp"):
        mesh_axis(mesh, view)  # made by build_mesh; slice them below by name
    return mesh[("dp_replicate", "ep_dp_shard_cp")], mesh[("dp_replicate", "dp_shard_cp")]


def gradient_sync(model: nn.Module, parallelism, last_microbatch: bool) -> None:
    """Step time, before each microbatch: under FSDP, reduce-scatter gradients only in the
    backward of the step's last microbatch (earlier ones accumulate unsharded); parameters
    not resharded after forward stay gathered until then too (one all-gather per step).
    Pipeline schedules do this themselves."""
    if parallelism.fsdp_enabled:
        model.set_requires_gradient_sync(last_microbatch)
        if not parallelism.reshard_after_forward:
            model.set_reshard_after_backward(last_microbatch)


def sync_replicated_grads(model: nn.Module, params: list[nn.Parameter], mesh, parallelism) -> None:
    """Step time, `dp_mode: replicate`: sum dense gradients over ep x dp x cp and expert
    gradients over dp x cp."""
    if not parallelism.replicate_enabled:
        return
    experts = expert_params(model)
    allreduce_grads([q for q in params if id(q) not in experts], mesh_axis(mesh, "ep_dp_cp").get_group())
    allreduce_grads([q for q in params if id(q) in experts], mesh_axis(mesh, "dp_cp").get_group())


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


IGNORE = -100  # the target of a token the loss mask excludes (cross_entropy's ignore_index)


def local_batch(recipe, source, step: int, batch_rank: int = 0, batch_ranks: int = 1):
    """(inputs, targets), each [n_microbatches * micro_batch_size, sequence_length]. A source
    with a loss mask (`source.masked`, data prepared with --chat) gives IGNORE as the target of
    every token its mask excludes."""
    indices = sample_indices(recipe, step, batch_rank, batch_ranks)
    rows = torch.stack([source(i) for i in indices])
    targets = rows[:, 1:].contiguous()
    if getattr(source, "masked", False):
        keep = torch.stack([source.loss_mask(i) for i in indices])[:, 1:].bool()
        targets = targets.masked_fill(~keep, IGNORE)
    return rows[:, :-1].contiguous(), targets


def loss_tokens(recipe, source, step: int, batches: int = 1) -> int:
    """The targets that count in the loss over global batches step .. step + batches - 1:
    every token of them, or with a loss mask the unmasked ones (read from the mask of every
    sample: the same number on every rank, at every mesh, with no communication)."""
    t = recipe.training
    if not getattr(source, "masked", False):
        return batches * t.global_batch_size * t.sequence_length
    first = step * t.global_batch_size
    return sum(int(source.loss_mask(i)[1:].sum()) for i in range(first, first + batches * t.global_batch_size))


def local_documents(recipe, source, step: int, batch_rank: int = 0, batch_ranks: int = 1) -> dict[str, torch.Tensor]:
    """The inputs' packed documents (data.document_masking): {"position_ids", "document_ids"},
    each [n_microbatches * micro_batch_size, sequence_length], the model's keyword arguments."""
    indices = sample_indices(recipe, step, batch_rank, batch_ranks)
    positions, documents = (torch.stack(t) for t in zip(*(source.documents(i) for i in indices)))
    return {"position_ids": positions[:, :-1].contiguous(), "document_ids": documents[:, :-1].contiguous()}


def rank_samples(recipe, coords: dict[str, int], source, step: int) -> tuple:
    """Step time: this rank's samples of global batch `step` (it shares them with its tp,
    cp and pp peers; ep x dp split the batch): (inputs, targets), and with
    data.document_masking the dict of local_documents after them."""
    p = recipe.parallelism
    where = (recipe, source, step, p.batch_rank(coords), p.batch_ranks)
    batch = local_batch(*where)
    return (*batch, local_documents(*where)) if recipe.data.document_masking else batch


def rows_of(docs: dict, rows: slice) -> dict:
    """One microbatch's rows of the documents' keyword arguments (empty: none)."""
    return {key: t[rows] for key, t in docs.items()}


def batch_to(batch: tuple, device: torch.device) -> tuple:
    """Every tensor of a batch (and of the documents' dict in it) on `device`."""
    return tuple({k: t.to(device) for k, t in x.items()} if isinstance(x, dict) else x.to(device) for x in batch)


def rank_sources(recipe, coords: dict[str, int], source, step: int) -> torch.Tensor:
    """Step time, a data mixture: the source index of each of this rank's samples (rank_samples'
    rows, in order)."""
    p = recipe.parallelism
    indices = sample_indices(recipe, step, p.batch_rank(coords), p.batch_ranks)
    return torch.tensor([source.source_of(i) for i in indices], dtype=torch.int64)
