"""Expert parallelism: each MoE layer's experts split over the ep mesh axis, tokens sent to
their experts' rank and back by all-to-all; tensor parallelism's share of the routed tokens;
the routing statistics and aux-loss-free balancing of a step.

Layout (nanotron's): ep is the outermost mesh axis. The batch is split over ep x dp, dense
parameters are replicated over ep (their gradients summed over ep x dp x cp) and the
experts are split over ep (gradients summed over dp x cp). Expert weights are DTensors
sharded on the expert dimension over ep, so init and checkpoints see the full tensors.

Under tp the experts (and the router and any shared expert) are replicated, and each tp rank
routes and computes a disjoint share of the microbatch's tokens (`TpTokenShare`): under
sequence parallelism (REDUCE_SCATTER) its sequence shard, which it already holds, so the MoE
layer needs no collective at all; under ALL_REDUCE a 1/tp slice of the replicated tokens,
whose outputs are all-gathered (backward: each rank keeps its slice's gradient; the slice's
backward all-gathers the input gradients). Why split the tokens rather than shard each
expert over tp: experts are small matrices already split over ep, and sharding them again
would add two collectives per layer for narrower matmuls, while replicated experts on the
whole sequence compute every routed token tp times (at tp 8, 8 times). Splitting the tokens
costs one all-reduce per step of the MoE parameters' gradients over tp (`sum_tp_grads`:
each rank's gradient covers its tokens only) and nothing per layer under sequence
parallelism. Megatron and torchtitan split the tokens too.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from ..models.layers import ExpertDispatch, TokenShare
from ..models.moe import MoE
from .shards import local


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


class _SplitTokens(torch.autograd.Function):
    """Forward: keep this rank's rows; backward: all-gather the row gradients (the input was
    replicated over tp, so its gradient must be whole on every rank)."""

    @staticmethod
    def forward(ctx, x, share):
        ctx.share = share
        return x[share.rows(x.shape[0])]

    @staticmethod
    def backward(ctx, g):
        return ctx.share.all_rows(g), None


class _GatherTokens(torch.autograd.Function):
    """Forward: all-gather every rank's rows; backward: keep this rank's rows of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, y, share, total: int):
        ctx.share, ctx.total = share, total
        return share.all_rows(y, total)

    @staticmethod
    def backward(ctx, g):
        return g[ctx.share.rows(ctx.total)], None, None


class TpTokenShare(TokenShare):
    """Each tp rank routes a disjoint share of the microbatch's tokens (see the module
    docstring). `sequence_parallel`: the MoE's input is already this rank's sequence shard."""

    def __init__(self, tp_mesh, sequence_parallel: bool):
        self.group, self.tp, self.rank = tp_mesh.get_group(), tp_mesh.size(), tp_mesh.get_local_rank()
        self.sequence_parallel = sequence_parallel

    def rows(self, total: int) -> slice:
        size = -(-total // self.tp)
        return slice(min(self.rank * size, total), min((self.rank + 1) * size, total))

    def all_rows(self, y: torch.Tensor, total: int | None = None) -> torch.Tensor:
        """Every rank's rows (ceil-sized pieces, the last ones short) in rank order [total, h]."""
        size = y.shape[0] if total is None else -(-total // self.tp)
        total = size * self.tp if total is None else total
        padded = y.new_zeros(size, *y.shape[1:])
        padded[: y.shape[0]] = y
        out = y.new_empty(size * self.tp, *y.shape[1:])
        dist.all_gather_into_tensor(out, padded.contiguous(), group=self.group)
        return out[:total]

    def split(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.sequence_parallel else _SplitTokens.apply(x, self)

    def gather(self, y: torch.Tensor, total: int) -> torch.Tensor:
        return y if self.sequence_parallel else _GatherTokens.apply(y, self, total)

    def sum_over_shares(self, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        return dist_fn.all_reduce(t, group=self.group), self.tp


def token_share(parallelism, mesh) -> TokenShare:
    """Build time: the model's share of the tokens (`ModelHooks.tokens`): a split over tp when tp > 1."""
    if not parallelism.tp_enabled:
        return TokenShare()
    return TpTokenShare(mesh["tp"], parallelism.sequence_parallel)


def moe_params(model: nn.Module) -> list[nn.Parameter]:
    """The trained parameters of every MoE layer: router, experts, shared expert."""
    return [q for m in moe_modules(model) for q in m.parameters() if q.requires_grad]


def sum_tp_grads(model: nn.Module, parallelism, mesh) -> None:
    """Step time, after backward: under tp each rank's MoE gradients cover its share of the
    tokens; sum them over tp (one all-reduce) so every tp rank holds the whole gradient."""
    if not parallelism.tp_enabled:
        return
    grads = [local(q.grad) for q in moe_params(model) if q.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=mesh["tp"].get_group())
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


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
