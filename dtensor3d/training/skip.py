"""Skipping a step: the step is computed and logged, but not applied.

`train.train_step` asks `reason_to_skip` after the step's one all-reduce; a reason (a short
phrase) means no optimizer step: the parameters, the optimizer's moments and its step
count (AdamW's bias correction) and the router's correction bias stay as they were, as
OLMo-core's skip-step optimizers leave them. The step number and the data position move on:
the next step reads the next batch. Whether the lr schedule moves on depends on the reason:

- "no counted tokens" (issue 43) advances it: the schedule stays the step number's function
  (as OLMo-core's scheduler is of the trainer's global step). Such a step is a property of the
  data, known from the masks alone; holding the schedule would not make the run equal to any
  run without that batch, and keeping it lets `plan`, the checkpoint's next_lr and a resumed
  run at another mesh read the lr from the step number, as for every other run.
- a spike (training.skip_spikes: `SpikeWindow`) holds it (HOLD_SCHEDULE), as issue 37 asks:
  the lr of step n is that of step n - held_steps (TrainState.held_steps, in the checkpoint).
  The skipped step then leaves no trace at all — weights, moments, AdamW's step count, the
  schedule and the window are those of a run whose data never held that batch — so a run
  that skips batch k equals the run fed the same batches without batch k. The window's
  history and held_steps are saved in the checkpoint (state.json: `spike_window`, `held_steps`).
- a non-finite step (training.on_nonfinite: skip, faults.SkipCount) advances it, as before.

Every rank must decide alike, so a reason may read only what every rank holds the same: the
global count of counted targets (data.loss_tokens reads the masks of the whole global batch
on every rank) and the all-reduced loss and grad norm (the same bits on every rank, so every
rank's window holds the same numbers). A check that needs more gathers it first. To add a
reason, add its check to `reason_to_skip` (and the reason to HOLD_SCHEDULE if it holds the lr).

A skipped step's record carries `skipped: true` and `skip_reason`, and is always written to
metrics.jsonl (whatever logging.every); `SkippedSteps` counts them and prints one `warning:`
line at the end of the run with their fraction, per reason. A non-finite step is skipped by
training.on_nonfinite (faults.SkipCount), counted there as `skipped_steps`.
"""

from __future__ import annotations

import math
from collections import deque

from ..config.stability_checks import skip_spikes_settings

NO_COUNTED_TOKENS = "no counted tokens"
LOSS_SPIKE = "a loss spike"
GRAD_NORM_SPIKE = "a grad-norm spike"
HOLD_SCHEDULE = (LOSS_SPIKE, GRAD_NORM_SPIKE)  # the reasons that hold the lr schedule (see above)


class SpikeWindow:
    """training.skip_spikes: the loss and grad norm of the last `window` applied steps. Once it
    is full, a step more than `sigma` sample standard deviations (n - 1) above the window's
    mean, in loss or in grad norm, is a spike; only applied steps enter the window."""

    def __init__(self, window: int, sigma: float):
        self.sigma = sigma
        self.losses: deque[float] = deque(maxlen=window)
        self.grad_norms: deque[float] = deque(maxlen=window)

    def spike(self, loss: float, grad_norm: float) -> str | None:
        if len(self.losses) < self.losses.maxlen:
            return None
        if loss > _bar(self.losses, self.sigma):
            return LOSS_SPIKE
        if grad_norm > _bar(self.grad_norms, self.sigma):
            return GRAD_NORM_SPIKE
        return None

    def add(self, loss: float, grad_norm: float) -> None:
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)

    def to_record(self) -> dict:
        """The checkpoint's piece (state.json's `spike_window`, checkpoint/save.py)."""
        return dict(losses=list(self.losses), grad_norms=list(self.grad_norms))  # not a metrics record

    def load(self, saved: dict | None) -> None:
        """A resumed run's window (checkpoint/resume.py); a window of another length keeps the newest."""
        self.losses.extend((saved or {}).get("losses", []))
        self.grad_norms.extend((saved or {}).get("grad_norms", []))


def _bar(values, sigma: float) -> float:
    """mean + sigma * sample standard deviation."""
    mean = sum(values) / len(values)
    return mean + sigma * math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def spike_window(training) -> SpikeWindow | None:
    """The run's empty window (None: training.skip_spikes is off)."""
    settings = skip_spikes_settings(training)
    return None if settings is None else SpikeWindow(*settings)


def applied(state, loss: float, grad_norm: float) -> None:
    """An applied step's loss and grad norm enter the window."""
    if state.spikes is not None:
        state.spikes.add(loss, grad_norm)


def reason_to_skip(state, loss_tokens: int | None, loss: float, grad_norm: float) -> str | None:
    """Why this step must not be applied (the same on every rank), or None to apply it: the
    first reason that holds. `state`: the TrainState (a check with its own history keeps it
    there); `loss_tokens`: the global count of counted targets (None: every target counts);
    `loss`, `grad_norm`: the step's, all-reduced."""
    if loss_tokens == 0:
        return NO_COUNTED_TOKENS
    if state.spikes is not None:
        return state.spikes.spike(loss, grad_norm)
    return None


def mark(metrics: dict, reason: str) -> None:
    """A skipped step's record: `skipped: true` and why."""
    metrics["skipped"], metrics["skip_reason"] = True, reason


WHY = {
    NO_COUNTED_TOKENS: "the loss mask (prepare-data --chat) left no target of their global batch: no assistant "
    "token in its windows; prepare-data --chat --sequence-length L counts the rows whose counted tokens do not fit",
    LOSS_SPIKE: "their loss was over training.skip_spikes.sigma standard deviations above the mean of the last "
    "window applied steps; the lr schedule held",
    GRAD_NORM_SPIKE: "their grad norm was over training.skip_spikes.sigma standard deviations above the mean of "
    "the last window applied steps; the lr schedule held",
}


class SkippedSteps:
    """The run's skipped steps, per reason; `warning()` the line at the end (None: none)."""

    def __init__(self):
        self.steps: dict[str, list[int]] = {}
        self.total = 0

    def count(self, metrics: dict) -> None:
        self.total += 1
        if metrics.get("skipped"):
            self.steps.setdefault(metrics["skip_reason"], []).append(metrics["step"])

    def warning(self) -> str | None:
        if not self.steps:
            return None
        parts = []
        for reason, steps in self.steps.items():
            shown = ", ".join(map(str, steps[:5])) + (f", ... ({len(steps)} in all)" if len(steps) > 5 else "")
            why = f"; {WHY[reason]}" if reason in WHY else ""
            fraction = f"{len(steps)} of {self.total} steps ({len(steps) / max(self.total, 1):.1%})"
            parts.append(f"{fraction} had {reason} and were skipped without an optimizer step (steps {shown}){why}")
        return "warning: " + "; ".join(parts)
