"""The training loop's cross-step concerns as step hooks, all called by the loop in one place
(train.run_step and train.train), in the order of the list `hooks(...)` builds.

A hook implements any of (every method of `StepHook` is a no-op by default):

    during_step(state)                   a context around the train step (profiling, the layout's counter)
    after_step(state, metrics, seconds)  after it: `metrics` is the step's record (a hook may add to it),
                                         `seconds` the train step's own time
    on_signal(state) -> str | None       an agreed SIGTERM/SIGINT stops the run after this step: what it saved
    at_end(state)                        at a normal end, collective (wait for a background save)
    close()                              always, last (also when the run stops early or fails)

The hooks: the layout probe (logging.layout), profiling (logging.profile_steps), evaluation
(training.eval_every), downstream evaluation (eval.tasks, harness/live.py), the metrics log,
the skipped steps' warning (training/skip.py) and checkpointing (checkpoint.dir). Preemption
and non-finite steps are faults (faults.Guard), which own no hook.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch.distributed as dist

from ..checkpoint import checkpoint_due
from ..datasets.sources import make_source
from ..errors import is_rank0
from ..parallel.comm import count_step
from ..parallel.shards import write_layout
from . import faults
from .evaluate import eval_due, validation_loss
from .metrics import MetricsLog, Stragglers, flops_per_token, mfu, peak_flops, peak_memory_gib, step_times
from .profiling import StepProfiler
from .skip import SkippedSteps


class StepHook:
    """The protocol; a hook overrides what it needs."""

    def during_step(self, state) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def after_step(self, state, metrics: dict, seconds: float) -> None:
        pass

    def on_signal(self, state) -> str | None:
        return None

    def at_end(self, state) -> None:
        pass

    def close(self) -> None:
        pass


class LayoutProbe(StepHook):
    """logging.layout: count the collectives of step 2 (step 1 also runs a pipeline's shape
    inference), then write the layout again with those bytes."""

    def __init__(self):
        self.counter = None

    @contextlib.contextmanager
    def during_step(self, state):
        if not (state.recipe.logging.layout and state.step == 1):
            yield
            return
        with count_step(state.mesh) as self.counter:
            yield

    def after_step(self, state, metrics: dict, seconds: float) -> None:
        if self.counter is not None:
            counter, self.counter = self.counter, None
            calls = {d: dict(kinds) for d, kinds in counter.calls.items()}
            write_layout(
                state.model, state.coords, dist.get_rank(), state.recipe.logging.run_dir, counter.result(), calls
            )


class Profiling(StepHook):
    """logging.profile_steps: a torch.profiler trace of those steps (profiling.StepProfiler)."""

    def __init__(self, state):
        logging = state.recipe.logging
        self.profiler = StepProfiler(logging.profile_steps, logging.run_dir, dist.get_rank(), state.device)

    def during_step(self, state):
        return self.profiler.step(state.step + 1)

    def close(self) -> None:
        self.profiler.close()


class Evaluation(StepHook):
    """training.eval_every: the validation loss into the step's metrics when due."""

    def __init__(self, compute_context: Callable):
        self.compute_context = compute_context

    def after_step(self, state, metrics: dict, seconds: float) -> None:
        if eval_due(state.recipe, state.step):
            source = make_source(state.recipe, "validation")
            metrics.update(validation_loss(state, source, self.compute_context(state)))


class DownstreamEval(StepHook):
    """eval.tasks every eval.every steps (and at the last): lm-evaluation-harness on the live
    model on every rank (harness/live.py); rank 0's record gets `eval/<task>/<metric>`."""

    def __init__(self, state, compute_context: Callable):
        from ..harness.live import LiveEval, quiet_harness

        quiet_harness()
        self.live, self.compute_context = LiveEval(state.recipe), compute_context

    def after_step(self, state, metrics: dict, seconds: float) -> None:
        every, steps = state.recipe.eval.every, state.recipe.training.steps
        if state.step % every == 0 or state.step == steps:
            with faults.collective_guard(f"step {state.step} (eval)", state.recipe.training.timeout_s):
                metrics.update(self.live.run(state, self.compute_context))


class MetricsLogging(StepHook):
    """The step's record into metrics.jsonl (rank 0) every logging.every steps, at the last
    step and with a validation loss, with its throughput, MFU and peak memory."""

    def __init__(self, state):
        recipe, t = state.recipe, state.recipe.training
        self.log = MetricsLog(recipe, enabled=is_rank0(), resume=state.step, wandb_id=state.wandb_id)
        if self.log.wandb is not None:
            state.wandb_id = self.log.wandb.id  # into every checkpoint's state.json
        self.tokens_per_step = t.global_batch_size * t.sequence_length
        self.flops_per_token = flops_per_token(recipe.model, t.sequence_length)
        given = recipe.logging.peak_tflops
        self.peak_flops = given * 1e12 if given else peak_flops(state.device)
        self.stragglers = Stragglers(recipe.logging.straggler_ratio, recipe.logging.straggler_steps)

    def after_step(self, state, metrics: dict, seconds: float) -> None:
        recipe = state.recipe
        times = step_times(seconds, state.device)  # every step, every rank: the straggler streaks
        for line in self.stragglers.see(state.step, times):
            if is_rank0():
                print(line, flush=True)
        due = not state.step % recipe.logging.every or state.step == recipe.training.steps
        evaluated = "val_loss" in metrics or any(key.startswith("eval/") for key in metrics)
        if not due and not evaluated and not metrics.get("skipped"):  # a skipped step: always
            return
        tps, ranks = self.tokens_per_step / seconds, dist.get_world_size()
        utilisation = mfu(tps, self.flops_per_token, self.peak_flops, ranks)
        memory = peak_memory_gib(state.device)
        metrics.update(tokens_per_sec=tps, ms_per_step=1000 * seconds, peak_mem_gib=memory, mfu=utilisation)
        slowest = max(range(len(times)), key=times.__getitem__)
        metrics.update(tflops=tps * self.flops_per_token / ranks / 1e12, step_ms_max=1000 * times[slowest])
        metrics.update(step_ms_min=1000 * min(times), slowest_rank=slowest)
        self.log.log(metrics)

    def close(self) -> None:
        self.log.close(announce=False)


class SkipWarning(StepHook):
    """Steps skipped for a reason (training/skip.py): one `warning:` line at the end of the
    run (rank 0) with their fraction."""

    def __init__(self):
        self.skipped = SkippedSteps()

    def after_step(self, state, metrics: dict, seconds: float) -> None:
        self.skipped.count(metrics)

    def at_end(self, state) -> None:
        line = self.skipped.warning()
        if line and is_rank0():
            print(line, flush=True)


class Checkpointing(StepHook):
    """checkpoint.dir: a checkpoint every checkpoint.interval steps and at the last one, one
    on an agreed signal (unless this step's was just saved), through the run's one Saver
    (checkpoint.background: sync or async). Make it before mesh.set_timeout: an async
    Saver makes its own group."""

    def __init__(self, state):
        from ..checkpoint.background import Saver

        self.saver = Saver(state)
        self.saved: tuple[int, str] | None = None  # (step, directory) of the newest save

    def after_step(self, state, metrics: dict, seconds: float) -> None:
        if checkpoint_due(state.recipe, state.step):
            with faults.collective_guard(f"step {state.step}", state.recipe.training.timeout_s):
                self.saved = state.step, self.saver.save(state)

    def on_signal(self, state) -> str | None:
        if self.saved is None or self.saved[0] != state.step:
            self.saved = state.step, self.saver.save(state)
        self.saver.wait()
        return self.saved[1]

    def at_end(self, state) -> None:
        with faults.collective_guard(f"step {state.step}", state.recipe.training.timeout_s):
            self.saver.wait()

    def close(self) -> None:
        """Let a background save of a good step finish."""
        if self.saver.thread is not None:
            self.saver.thread.join()


def hooks(state, compute_context: Callable) -> list[StepHook]:
    """This run's hooks, in the order the loop calls them: the layout first (right after the
    step), evaluation before the log (the record carries val_loss), checkpointing last."""
    found: list[StepHook] = [LayoutProbe(), Profiling(state), Evaluation(compute_context)]
    if state.recipe.eval.tasks:
        found.append(DownstreamEval(state, compute_context))
    found.append(MetricsLogging(state))
    found.append(SkipWarning())  # after the log: its line comes after the last step's
    if state.recipe.checkpoint.dir:
        found.append(Checkpointing(state))
    return found


@contextlib.contextmanager
def during_step(found: list[StepHook], state):
    """Every hook's context around one train step."""
    with contextlib.ExitStack() as stack:
        for hook in found:
            stack.enter_context(hook.during_step(state))
        yield
