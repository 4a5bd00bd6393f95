"""Context parallelism: each sequence split over the cp ranks, attention still exact.

Load balancing for causal attention: the sequence is cut into 2*cp chunks and cp rank i
holds chunks i and 2*cp-1-i, so every rank has one early and one late chunk and the same
number of (query, key) pairs to score. Attention gathers K and V from the cp group (an
autograd function whose backward reduce-scatters their gradients), and masks by global
position: a query attends to every key at the same or an earlier position. RoPE uses the
same global positions. PyTorch's own `context_parallel` has no rule for the CPU attention
kernel, so this one path serves CPU and GPU.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def zigzag_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions held by cp rank `rank`: chunks rank and 2*cp-1-rank of 2*cp."""
    chunk = seq_len // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's tokens of a full-sequence tensor."""
    return x.index_select(dim, zigzag_positions(x.shape[dim], cp, rank).to(x.device))


class _GatherSequence(torch.autograd.Function):
    """all-gather along `dim` over `group`; backward sums the gradient over the group and
    keeps this rank's piece (reduce-scatter where the backend has it, else all-reduce)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group, dim = ctx.group, ctx.dim
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        pieces = [p.contiguous() for p in grad.chunk(n, dim=dim)]
        if dist.get_backend(group) == "nccl":
            out = torch.empty_like(pieces[rank])
            dist.reduce_scatter(out, pieces, group=group)
            return out, None, None
        grad = grad.contiguous()
        dist.all_reduce(grad, group=group)  # gloo has no reduce-scatter
        return grad.chunk(n, dim=dim)[rank].contiguous(), None, None


def gather_sequence(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    return _GatherSequence.apply(x, group, dim)


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group,
                 q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Exact causal attention for this rank's queries over the whole sequence's keys.

    q: [b, h, s_local, d]; k, v: [b, kv_h, s_local, d]; q_pos: [s_local] global positions of
    this rank's tokens; k_pos: [s] global positions of the gathered keys (cp-rank order)."""
    k, v = gather_sequence(k, group, 2), gather_sequence(v, group, 2)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    mask = k_pos[None, :] <= q_pos[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def apply_cp(model: nn.Module, cp_mesh, seq_len: int, device: torch.device) -> nn.Module:
    """Give every attention layer the cp kernel and the model its tokens' global positions."""
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    q_pos = zigzag_positions(seq_len, cp, rank).to(device)
    k_pos = torch.cat([zigzag_positions(seq_len, cp, r) for r in range(cp)]).to(device)
    model.model.positions = q_pos
    kernel = functools.partial(cp_attention, group=cp_mesh.get_group(), q_pos=q_pos, k_pos=k_pos)
    for block in model.model.layers.values():
        block.self_attn.attention_fn = kernel
    return model


def attention_pairs(seq_len: int, cp: int) -> list[int]:
    """Causal (query, key) pairs each cp rank scores: the load balance of the layout."""
    return [int((zigzag_positions(seq_len, cp, r) + 1).sum()) for r in range(cp)]
