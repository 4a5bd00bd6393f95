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


def keep_curve_advice(opt, saved: dict, saved_steps: int, steps: int, step: int) -> str:
    """How to resume a run whose training.steps grew from saved_steps to steps without a jump
    in the lr at `step`. `saved` is the saved recipe's optimizer section (decay_start and
    decay_steps absent in older checkpoints: null). Before the saved decay began: move the same
    decay to the new end (the stable phase grows); inside it: keep the saved decay window."""
    if opt.decay == "constant":
        return "optimizer.decay=constant keeps the lr"
    start = saved.get("decay_start")
    start = opt.warmup_steps if start is None else start
    length = saved.get("decay_steps")
    if length is None and (saved_steps <= start or (step < opt.warmup_steps and saved.get("decay_start") is None)):
        # Still in warmup with the default decay, or saved before its decay began: the decay's length was
        # never fixed; the defaults stretch it to the new end, which keeps the saved schedule's shape.
        return (
            f"the saved schedule's shape (warmup, then the {opt.decay} decay from step {start + 1} down to "
            f"min_lr at the last step) is kept as recomputed: nothing to set (keep optimizer.decay_steps=null)"
        )
    length = max(1, saved_steps - start) if length is None else length
    if step < start and steps - length >= start:
        return (
            f"to extend the stable phase without a jump, move the saved decay to the new end: "
            f"optimizer.decay_start={steps - length} optimizer.decay_steps={length}"
        )
    return (
        f"to keep the saved run's curve (its decay, then min_lr), set "
        f"optimizer.decay_start={start} optimizer.decay_steps={length}"
    )


def decay_past_end(opt, total_steps: int) -> str | None:
    """The warning's text when the decay the user wrote (decay_start + decay_steps) ends past
    training.steps: allowed, the run stops part-way down it. None otherwise."""
    if opt.decay == "constant" or opt.decay_steps is None:
        return None
    start, length = decay_window(opt, total_steps)
    if start + length <= total_steps:
        return None
    return (
        f"optimizer.decay_start={start} + decay_steps={length} ends the decay at step {start + length}, "
        f"past training.steps={total_steps}: the run stops part-way down it, at lr "
        f"{lr_at(total_steps - 1, opt, total_steps):.3e} (min_lr={opt.min_lr:g})"
    )
