"""The learning-rate schedule from its formula, written in the tests independently of
dtensor3d/optim.py, for the tests that check the lr a run used."""

from __future__ import annotations

import math


def scheduled_lr(step: int, opt, total_steps: int) -> float:
    """lr used by optimizer step `step` (0-based): linear warmup over warmup_steps reaching
    the peak on the last warmup step, then cosine / linear decay from the peak toward
    min_lr (reached at step total_steps, one past the last), or constant at the peak."""
    w = opt.warmup_steps
    if w and step < w:
        return opt.lr * (step + 1) / w
    progress = min(1.0, (step - w) / max(1, total_steps - w))
    if opt.decay == "cosine":
        return opt.min_lr + 0.5 * (opt.lr - opt.min_lr) * (1.0 + math.cos(math.pi * progress))
    if opt.decay == "linear":
        return opt.lr - (opt.lr - opt.min_lr) * progress
    assert opt.decay == "constant", opt.decay
    return opt.lr
