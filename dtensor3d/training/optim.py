"""AdamW and gradient clipping on the global norm (the LR schedule's formula: config/lr.py)."""

from __future__ import annotations

import torch
from torch import nn

from ..parallel.shards import local


def _mesh_key(p: torch.Tensor) -> tuple:
    """Parameters on different meshes must not share a foreach kernel (one per group)."""
    if hasattr(p, "device_mesh"):
        return (p.device_mesh.mesh_dim_names, tuple(str(pl) for pl in p.placements))
    return ()


def build_optimizer(model_parts: list[nn.Module], opt) -> torch.optim.Optimizer:
    """optimizer.name: adamw (every parameter) or muon (training/muon.py: the decoder layers'
    matrices on Muon, the rest on this AdamW). Each group's scheduled lr is lr_at times its
    `lr_scale` (absent: 1)."""
    if opt.name == "muon":
        from .muon import build_muon

        return build_muon(model_parts, opt, adamw)
    return adamw([p for part in model_parts for p in part.parameters() if p.requires_grad], opt)


def adamw(params: list[torch.Tensor], opt) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only, one param group per (decay, mesh). The moments
    in optimizer.state_dtype: torch's AdamW (float32), or torchao's bf16 / 8-bit state AdamW
    (training/optim_lowp.py). DTensor parameters (tp, FSDP) take torch's foreach kernels on
    every device: torch picks them on CUDA only, and on CPU its per-parameter loop sends each
    of ~7 ops a parameter through DTensor's Python dispatch (41 against 16 ms a step for the
    peers model's 39 parameters on a one-rank mesh, bench/peers.py's shape). Plain CPU tensors
    keep the loop, faster there (16 against 21 ms). Both paths give the same bits
    (tests/training/test_optim.py)."""
    groups: dict[tuple, list] = {}
    for p in params:
        groups.setdefault((p.ndim >= 2, _mesh_key(p)), []).append(p)
    param_groups = [
        {"params": ps, "weight_decay": opt.weight_decay if decay else 0.0} for (decay, _), ps in groups.items()
    ]
    if opt.state_dtype != "float32":
        from .optim_lowp import low_precision_adamw

        return low_precision_adamw(param_groups, opt)
    foreach = True if any(hasattr(p, "device_mesh") for p in params) else None  # None: torch's choice
    return torch.optim.AdamW(param_groups, lr=opt.lr, betas=opt.betas, eps=opt.eps, foreach=foreach)


def replication(p: torch.Tensor, world_size: int, pp: int) -> int:
    """How many ranks hold an identical copy of this parameter's local piece."""
    distinct = pp  # stages hold different parameters
    if hasattr(p, "device_mesh"):
        for size, placement in zip(p.device_mesh.shape, p.placements):
            if not placement.is_replicate():  # Shard, or FSDP's _StridedShard over tp
                distinct *= size
    return world_size // distinct


def grad_sq_partial(params: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """This rank's share of the squared global gradient norm: a world-sum of these is the
    squared norm of the full gradient (each copy weighted by 1 / its replication)."""
    grads = [local(p.grad) for p in params if p.grad is not None]
    w = [wt for p, wt in zip(params, weights) if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    norms = torch._foreach_norm([g.float() for g in grads])
    return sum(n.square() * wt for n, wt in zip(norms, w))


def clip_(params: list[torch.Tensor], total_norm: float, max_norm: float) -> None:
    """Scale gradients so their global norm is at most max_norm (torch's formula)."""
    if max_norm <= 0:
        return
    coef = min(1.0, max_norm / (total_norm + 1e-6))
    if coef < 1.0:
        torch._foreach_mul_([local(p.grad) for p in params if p.grad is not None], coef)
