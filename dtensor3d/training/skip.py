"""Skipping a step: the step is computed and logged, but not applied.

`train.train_step` asks `reason_to_skip` after the step's one all-reduce; a reason (a short
phrase) means no optimizer step: the parameters, the optimizer's moments and its step
count (AdamW's bias correction) and the router's correction bias stay as they were, as
OLMo-core's skip-step optimizers leave them. The step number, the data position and the lr
schedule move on (the schedule is a function of the step number, as OLMo-core's scheduler is
of the trainer's global step): the next step reads the next batch at the next step's lr.

Every rank must decide alike, so a reason may read only what every rank holds the same: the
global count of counted targets (data.loss_tokens reads the masks of the whole global batch
on every rank) and the all-reduced loss and grad norm. A check that needs more gathers it
first. To add a reason (training.skip_spikes, say), add its check to `reason_to_skip`.

A skipped step's record carries `skipped: true` and `skip_reason`, and is always written to
metrics.jsonl (whatever logging.every); `SkippedSteps` counts them and prints one `warning:`
line at the end of the run with their fraction, per reason. A non-finite step is skipped by
training.on_nonfinite (faults.SkipCount), counted there as `skipped_steps`.
"""

from __future__ import annotations

NO_COUNTED_TOKENS = "no counted tokens"


def reason_to_skip(state, loss_tokens: int | None, loss: float, grad_norm: float) -> str | None:
    """Why this step must not be applied (the same on every rank), or None to apply it: the
    first reason that holds. `state`: the TrainState (a check with its own history keeps it
    there); `loss_tokens`: the global count of counted targets (None: every target counts);
    `loss`, `grad_norm`: the step's, all-reduced."""
    if loss_tokens == 0:
        return NO_COUNTED_TOKENS
    return None


def mark(metrics: dict, reason: str) -> None:
    """A skipped step's record: `skipped: true` and why."""
    metrics["skipped"], metrics["skip_reason"] = True, reason


WHY = {
    NO_COUNTED_TOKENS: "the loss mask (prepare-data --chat) left no target of their global batch: no assistant "
    "token in its windows; prepare-data --chat --sequence-length L counts the rows whose counted tokens do not fit",
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
