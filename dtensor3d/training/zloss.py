"""The z-loss (training.z_loss; PaLM, OLMo): `coef * mean(logsumexp(logits)^2)` over the counted
targets, added to the backpropagated loss to keep the softmax's normaliser near 1.

The mean is taken like the cross-entropy's (train.make_loss_fn): each microbatch's sum over its
counted targets, divided by the global batch's target count (and renormalised with it where a
loss mask leaves fewer: train.renormalise), so the value is the same at any mesh. Under
vocab-parallel logits (tp with `loss_parallel`: a DTensor sharded on the vocabulary) the
log-sum-exp is computed without gathering the vocabulary: each rank's max, all-reduced (MAX),
and each rank's sum of exp(logit - max), all-reduced (SUM, `_SumOfReplicated`). Only a
grad-enabled (training) forward adds it: validation reports the cross-entropy alone. The step
logs it as `z_loss`; `loss` stays the cross-entropy (the parts recorded here are taken off it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from ..parallel.shards import local


class _SumOfReplicated(torch.autograd.Function):
    """all-reduce forward, identity backward: a sum every tp rank then uses alike (the same
    replicated loss on each rank), so each rank's gradient is already the whole one
    (picotron's g: the reduce of a row-parallel output)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last (vocabulary) dim, in fp32: [..., vocab] -> [...], a plain tensor.
    A DTensor sharded on the vocabulary: max and sum of exp all-reduced over its mesh dim."""
    if not isinstance(logits, DTensor):
        return torch.logsumexp(logits.float(), dim=-1)
    vocab_dims = [i for i, p in enumerate(logits.placements) if p.is_shard(logits.ndim - 1) or p.is_shard(-1)]
    x = logits.to_local().float()
    if not vocab_dims:
        return torch.logsumexp(x, dim=-1)
    group = logits.device_mesh.get_group(vocab_dims[0])
    peak = x.detach().amax(-1, keepdim=True)  # the gradient of lse does not depend on the shift
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    sums = _SumOfReplicated.apply((x - peak).exp().sum(-1), group)
    return peak.squeeze(-1) + sums.log()


def z_term(logits: torch.Tensor, targets: torch.Tensor, coef: float, global_tokens: int, ignore: int):
    """coef * sum(lse^2 over the counted targets) / global_tokens, laid out as the logits' loss
    is (a replicated DTensor where the logits are DTensors, for the sum with the CE)."""
    lse = logsumexp(logits)
    counted = (targets != ignore).to(lse.dtype)
    z = coef * (lse.square() * counted).sum() / global_tokens
    if isinstance(logits, DTensor):
        mesh = logits.device_mesh
        return DTensor.from_local(z, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return z


def with_z_loss(loss_fn, coef: float, global_tokens: int, ignore: int, parts: list):
    """make_loss_fn's loss plus the z-loss in a grad-enabled forward; each such call appends its
    detached z to `parts` (take)."""

    def z_loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(logits, targets)
        if not torch.is_grad_enabled():
            return loss
        z = z_term(logits, targets, coef, global_tokens, ignore)
        parts.append(local(z.detach()).float())
        return loss + z

    return z_loss_fn


def take(parts: list, microbatches: int, device) -> torch.Tensor:
    """The step's z-loss sum on this rank (zero where it computes no loss): the last
    `microbatches` parts (a pipeline schedule's shape inference also calls the loss). Clears."""
    total = torch.stack(parts[-microbatches:]).sum().to(device) if parts else torch.zeros((), device=device)
    parts.clear()
    return total
