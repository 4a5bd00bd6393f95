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


def apply_ep(model: nn.Module, ep_mesh) -> nn.Module:
    """Shard every MoE layer's experts over the ep axis and route its tokens by all-to-all."""
    for module in model.modules():
        if isinstance(module, MoE):
            experts = module.experts
            for name, param in list(experts.named_parameters(recurse=False)):
                sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
                experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
            module.dispatch = functools.partial(ep_dispatch, group=ep_mesh.get_group())
    return model


def moe_modules(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]
