"""Expert parallelism: each MoE layer's experts split over the ep mesh axis, tokens sent to
their experts' rank and back by all-to-all.

Layout (nanotron's): ep is the outermost mesh axis. The batch is split over ep x dp, dense
parameters are replicated over ep (their gradients summed over ep x dp x cp) and the
experts are split over ep (gradients summed over dp x cp). Expert weights are DTensors
sharded on the expert dimension over ep, so init and checkpoints see the full tensors.

Experts are replicated over tp: every tp rank runs the MoE on the same (gathered) tokens.
Each expert is a small matrix and ep is the axis that splits them; sharding them over tp as
well would add two collectives per layer for matmuls that are already narrow.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from ..models.layers import ExpertDispatch
from ..models.moe import MoE


def _by_expert(counts: torch.Tensor) -> torch.Tensor:
    """counts [src, local_e] of rows laid out (src, expert)-major; the row order that
    regroups them (expert, src)-major."""
    starts = (counts.reshape(-1).cumsum(0) - counts.reshape(-1)).reshape(counts.shape)
    pieces = [
        torch.arange(int(starts[s, e]), int(starts[s, e] + counts[s, e]))
        for e in range(counts.shape[1])
        for s in range(counts.shape[0])
    ]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def ep_dispatch(experts: nn.Module, x_sorted: torch.Tensor, counts: torch.Tensor, *, group) -> torch.Tensor:
    """Run tokens sorted by global expert through experts spread over `group`.

    Split sizes are exchanged first, then the tokens go all-to-all to the rank holding their
    expert, are regrouped by local expert, processed, and return by the inverse route. Both
    all-to-alls are autograd functions: backward sends the gradients the same way back."""
    ep = dist.get_world_size(group)
    local_e = counts.numel() // ep
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=group)
    send_counts, recv_counts = counts.reshape(ep, local_e), recv.reshape(ep, local_e)
    send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    arrived = dist_fn.all_to_all_single(
        x_sorted.new_empty(sum(recv_splits), x_sorted.shape[1]),
        x_sorted.contiguous(),
        recv_splits,
        send_splits,
        group=group,
    )
    order = _by_expert(recv_counts.cpu()).to(x_sorted.device)
    out = experts(arrived[order], recv_counts.sum(0).tolist())
    back = torch.empty_like(out).index_copy(0, order, out)
    return dist_fn.all_to_all_single(x_sorted.new_empty(x_sorted.shape), back, send_splits, recv_splits, group=group)


def expert_dispatch(parallelism, mesh) -> ExpertDispatch | None:
    """Build time: the model's route to its experts (`ModelHooks.expert_dispatch`): all-to-all
    over the ep axis when ep > 1, else None (every expert is local)."""
    if not parallelism.ep_enabled:
        return None
    return functools.partial(ep_dispatch, group=mesh["ep"].get_group())


def aux_loss_scale(recipe) -> float:
    """Gradient scale of each MoE layer's balance loss per microbatch forward: the loss is
    coef x (mean over all microbatches of the global batch, on every batch rank)."""
    return recipe.model.router_aux_loss_coef / (recipe.num_microbatches * recipe.parallelism.batch_ranks)


def shard_experts(model: nn.Module, ep_mesh) -> nn.Module:
    """Build time: every MoE layer's stacked expert weights become DTensors sharded on the
    expert dimension over the ep axis (this rank keeps num_experts / ep of them)."""
    for module in moe_modules(model):
        experts = module.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    return model


def moe_modules(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def expert_params(model: nn.Module) -> set[int]:
    """ids of the expert weights (sharded over ep, replicated over dp x cp)."""
    return {id(q) for m in moe_modules(model) for q in m.experts.parameters()}


def step_stats(model: nn.Module, recipe, coords: dict[str, int], device: torch.device) -> torch.Tensor:
    """Step time: [aux loss term, tokens per expert...] of this rank's MoE layers this step
    (the last n-microbatches forwards of each), counted once over the ranks that share them
    (aux: tp and cp rank 0; loads: tp rank 0), to be summed over the world. Zeros when the
    model has no experts."""
    n_micro, scale = recipe.num_microbatches, aux_loss_scale(recipe)
    out = torch.zeros(1 + recipe.model.num_local_experts, device=device)
    for moe in moe_modules(model):
        for aux, load in moe.take_records(n_micro):
            if coords["tp"] == 0:
                out[0] += aux.to(out.device).float() * scale * (coords["cp"] == 0)
                out[1:] += load.to(out.device)
    return out


def stats_metrics(stats: torch.Tensor) -> dict:
    """The metrics of `step_stats` summed over the world."""
    load = stats[1:]
    return {
        "aux_loss": stats[0].item(),
        "tokens_per_expert": [int(round(x)) for x in load.tolist()],
        "expert_load_max_over_mean": (load.max() / load.mean().clamp_min(1e-9)).item(),
    }
