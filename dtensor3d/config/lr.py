"""The learning-rate schedule's formula: pure Python, shared by the optimizer (training/),
the checkpoint record (`next_lr`) and `plan`."""

from __future__ import annotations

import math

_SHAPES = {
    "cosine": lambda f: 0.5 * (1 + math.cos(math.pi * f)),
    "linear": lambda f: 1 - f,
    "1-sqrt": lambda f: 1 - math.sqrt(f),
}


def decay_window(opt, total_steps: int) -> tuple[int, int]:
    """(first decay step, decay length): decay_start (null: warmup's end) and decay_steps
    (null: to step total_steps, one past the last)."""
    start = opt.warmup_steps if opt.decay_start is None else opt.decay_start
    length = total_steps - start if opt.decay_steps is None else opt.decay_steps
    return start, max(1, length)


def lr_at(step: int, opt, total_steps: int) -> float:
    """Linear warmup to `lr`, hold at `lr` until decay_start (warmup-stable-decay), then a
    cosine / linear / 1-sqrt decay over decay_steps to `min_lr`, then hold at `min_lr`;
    `constant` keeps `lr` after warmup."""
    if step < opt.warmup_steps:
        return opt.lr * (step + 1) / opt.warmup_steps
    start, length = decay_window(opt, total_steps)
    if opt.decay == "constant" or step < start:
        return opt.lr
    frac = min(1.0, (step - start) / length)
    return opt.min_lr + (opt.lr - opt.min_lr) * _SHAPES[opt.decay](frac)
