"""One rank of bench/plan_accuracy.py (run under torchrun): train steps 1 and 2 of a recipe and
print what step 2 cost this rank, as one line `ACCURACY {json}`.

Measured on step 2 (step 1 also creates the optimizer state and runs the pipeline's shape
inference): the bytes handed to each collective per mesh dim and kind
(dtensor3d.parallel.comm.count_step); the live tensor bytes at the step's start and at its
peak (bench/live_bytes.py, tracking every storage since before `setup`); the parameter,
gradient and AdamW bytes after the step; under pp the wall time of the schedule's step and
the time this rank's stage spent computing (PipelineStage.forward_one_chunk and
backward_one_chunk), the rest being idle.

usage: torchrun --nproc_per_node=N bench/accuracy_rank.py RECIPE [key=value ...]
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from live_bytes import LiveBytes

from dtensor3d.config.load import load_recipe
from dtensor3d.datasets.sources import make_source
from dtensor3d.parallel.comm import count_step
from dtensor3d.parallel.shards import local
from dtensor3d.training.train import rank_batch, setup, train_step


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def state_bytes(state) -> dict:
    """Parameters (each local storage: FSDP2's padded shard), gradients, AdamW state."""
    params = [local(q) for q in state.model.parameters()]
    grads = [local(q.grad) for q in state.model.parameters() if q.grad is not None]
    opt = [local(v) for st in state.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    return {
        "params": sum(t.numel() for t in params),
        "param_bytes": sum(t.untyped_storage().nbytes() for t in params),
        "grad_bytes": nbytes(grads),
        "optimizer_bytes": nbytes(opt),
    }


class StageClock:
    """Seconds this rank's pipeline stages spend in forward and backward compute, and the
    wall time of the schedule's steps, while `on`."""

    def __init__(self, schedule):
        self.busy = self.wall = 0.0
        self.on = False
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        for stage in stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(getattr(stage, name), "busy"))
        schedule.step = self._timed(schedule.step, "wall")

    def _timed(self, fn, field: str):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.on:
                    setattr(self, field, getattr(self, field) + time.perf_counter() - start)

        return run


def main() -> None:
    recipe_path, *overrides = sys.argv[1:]
    recipe = load_recipe(recipe_path, overrides, world_size=int(os.environ["WORLD_SIZE"]))
    live = LiveBytes()
    with live:
        state = setup(recipe)
        clock = StageClock(state.schedule) if state.schedule is not None else None
        source = make_source(recipe)
        train_step(state, rank_batch(state, source, 0))
        batch = rank_batch(state, source, 1)
        dist.barrier()
        live.reset_peak()
        start = live.now
        if clock:
            clock.on = True
        with count_step(state.mesh) as counter:
            train_step(state, batch)
        if clock:
            clock.on = False
        out = {"rank": dist.get_rank(), "coords": state.coords, "comm": counter.result()}
        out |= {"live_at_start": start, "peak": live.peak} | state_bytes(state)
    if clock:
        out |= {"stage_busy_s": clock.busy, "step_wall_s": clock.wall}
    print("ACCURACY " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
