"""Profiling: `logging.profile_steps: [first, last]` -> one torch.profiler trace per rank of
those steps (Chrome trace JSON, opens in Perfetto or chrome://tracing) in
<run_dir>/profile/trace_rank<R>.json, and on CUDA a memory snapshot beside it
(memory_rank<R>.pickle, for pytorch.org/memory_viz).

The loop wraps each step through the step hook hooks.Profiling:

    profiler = StepProfiler(recipe.logging.profile_steps, recipe.logging.run_dir, rank, device)
    with profiler.step(state.step + 1):   # the 1-based number of the step about to run
        metrics = train_step(state, batch)
    profiler.close()                       # at the end, also when a run stops early
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch


class StepProfiler:
    """Profiles steps first..last (1-based, as metrics.jsonl numbers them); a no-op otherwise."""

    def __init__(self, steps: tuple[int, ...] | list[int] | None, run_dir: str, rank: int, device: torch.device):
        self.first, self.last = (steps[0], steps[1]) if steps else (0, -1)
        self.dir = os.path.join(run_dir, "profile")
        self.rank, self.cuda = rank, device.type == "cuda"
        self.prof: torch.profiler.profile | None = None
        self.trace_path: str | None = None

    @contextlib.contextmanager
    def step(self, number: int) -> Iterator[None]:
        """Run one training step (number: 1-based) under the profiler when it is in range."""
        if self.prof is None and self.first <= number <= self.last:
            self._start()
        if self.prof is None:
            yield
            return
        with torch.profiler.record_function(f"train_step {number}"):
            yield
        if number >= self.last:
            self.close()

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.prof = torch.profiler.profile(activities=activities, record_shapes=True, with_stack=False)
        self.prof.__enter__()

    def close(self) -> None:
        """Stop and write the trace (and the CUDA memory snapshot); nothing if not profiling."""
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        os.makedirs(self.dir, exist_ok=True)
        self.trace_path = os.path.join(self.dir, f"trace_rank{self.rank}.json")
        prof.export_chrome_trace(self.trace_path)
        if self.cuda:
            torch.cuda.memory._dump_snapshot(os.path.join(self.dir, f"memory_rank{self.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
