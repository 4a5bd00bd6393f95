"""Would sequence parallelism train faster on gloo with all-reduce + slice instead of
reduce-scatter? (issue 25; the lever BENCHMARKS.md's "Peers" left untried):

    torchrun --nproc-per-node 2 bench/sp_allreduce_slice.py [--steps 16]

gloo's reduce-scatter costs 1.3-1.6x its all-reduce of the same tensor
(bench/tp_collectives.py). This builds bench/peers.py's shape at tp 2 three times in one
process pair and steps the three in turn, step by step: REDUCE_SCATTER as it is; REDUCE_SCATTER with every
reduce-scatter DTensor issues (the row-parallel outputs forward, the sequence gathers'
gradients backward) replaced, for this run only, by an all-reduce of the whole tensor and
a slice of this rank's shard (the same result; one collective kind gloo runs faster); and
ALL_REDUCE. Printed: tokens/s of each (median step after the first) and the
ratios to REDUCE_SCATTER as it is. An experiment on torch's internals (it replaces
torch.distributed.tensor's reduce_scatter_single for the run), not a dtensor3d option.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUPS = {
    "REDUCE_SCATTER": ["parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER"],
    "REDUCE_SCATTER, all-reduce + slice": ["parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER"],
    "ALL_REDUCE": ["parallelism.tp=2", "parallelism.tp_mode=ALL_REDUCE"],
}


def all_reduce_then_slice(reduce_scatter):
    """torch.distributed.tensor's reduce_scatter_single, replaced while `on[0]` holds."""
    import torch.distributed._functional_collectives as funcol

    on = [False]

    def replaced(tensor, reduce_op, scatter_dim, group, tag=""):
        if not on[0]:
            return reduce_scatter(tensor, reduce_op, scatter_dim, group, tag)
        mesh, dim = group
        whole = funcol.all_reduce(tensor, reduce_op, group)
        return whole.chunk(mesh.size(dim), dim=scatter_dim)[mesh.get_local_rank(dim)].contiguous()

    return replaced, on


def flagged(steps, on: list, value: bool):
    """A step generator whose every step runs with on[0] = value."""
    while True:
        on[0] = value
        yield next(steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
    import peers
    import torch
    import torch.distributed as dist
    import torch.distributed.tensor.placement_types as placements

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    placements.funcol.reduce_scatter_single, on = all_reduce_then_slice(placements.funcol.reduce_scatter_single)
    runs = {name: flagged(peers.ours_steps(peers.FULL, o), on, "slice" in name) for name, o in SETUPS.items()}
    times = {name: t[1:] for name, t in peers.in_turn(runs, args.steps).items()}
    if dist.get_rank() == 0:
        tokens = peers.FULL["batch"] * peers.FULL["seq"]
        base = tokens / statistics.median(times["REDUCE_SCATTER"])
        for name, t in times.items():
            speed = tokens / statistics.median(t)
            print(f"{name:36s} {speed:8,.0f} tok/s  x{speed / base:.2f} REDUCE_SCATTER", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
