"""Door checks of the optimizer section (AdamW's and Muon's keys, the lr schedule's decay).
Each raises one `RecipeError` line naming the key, the value and what is valid."""

from __future__ import annotations

from ..errors import RecipeError
from .schema import OptimizerConfig


def validate_optimizer(o: OptimizerConfig) -> None:
    if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
        raise RecipeError(f"optimizer.lr={o.lr}, min_lr={o.min_lr}: need lr > 0 and 0 <= min_lr <= lr")
    if o.warmup_steps < 0 or o.clip_grad < 0 or o.weight_decay < 0 or o.eps <= 0:
        raise RecipeError(
            "optimizer: warmup_steps, clip_grad and weight_decay must be >= 0 and eps > 0 "
            f"(got {o.warmup_steps}, {o.clip_grad}, {o.weight_decay}, {o.eps})"
        )
    if not all(0.0 <= b < 1.0 for b in o.betas):
        raise RecipeError(f"optimizer.betas={list(o.betas)}: each beta must be in [0, 1)")
    if not 1 <= o.muon_ns_steps < 100:
        raise RecipeError(
            f"optimizer.muon_ns_steps={o.muon_ns_steps}: Newton-Schulz needs 1 to 99 iterations (torch.optim.Muon's)"
        )
    if not 0.0 <= o.muon_momentum < 1.0:
        raise RecipeError(f"optimizer.muon_momentum={o.muon_momentum}: must be in [0, 1)")
    if o.muon_lr is not None and o.muon_lr <= 0:
        raise RecipeError(f"optimizer.muon_lr={o.muon_lr}: need > 0; null: optimizer.lr")


def validate_decay(o: OptimizerConfig, steps: int) -> None:
    """decay_start within [warmup_steps, training.steps]; decay_steps >= 1. A decay that ends
    past the last step is allowed: the run stops part-way down it."""
    if o.decay_start is not None and not o.warmup_steps <= o.decay_start <= steps:
        raise RecipeError(
            f"optimizer.decay_start={o.decay_start}: the decay must begin between the warmup's end "
            f"(warmup_steps={o.warmup_steps}) and training.steps={steps}; null: right after warmup"
        )
    if o.decay_steps is not None and o.decay_steps < 1:
        raise RecipeError(f"optimizer.decay_steps={o.decay_steps}: need >= 1; null: decay to the last step")
