"""The learning-rate schedule's formula: pure Python, shared by the optimizer (training/),
the checkpoint record (`next_lr`) and `plan`."""

from __future__ import annotations

import math


def lr_at(step: int, opt, total_steps: int) -> float:
    """Linear warmup to `lr`, then cosine / linear / constant decay to `min_lr`."""
    if step < opt.warmup_steps:
        return opt.lr * (step + 1) / opt.warmup_steps
    if opt.decay == "constant":
        return opt.lr
    span = max(1, total_steps - opt.warmup_steps)
    frac = min(1.0, (step - opt.warmup_steps) / span)
    shape = 0.5 * (1 + math.cos(math.pi * frac)) if opt.decay == "cosine" else 1 - frac
    return opt.min_lr + (opt.lr - opt.min_lr) * shape
