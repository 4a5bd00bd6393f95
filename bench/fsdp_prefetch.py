"""Would FSDP2 on CPU train faster if each unit prefetched the next one's all-gather? (issue 25)

    torchrun --nproc-per-node 2 bench/fsdp_prefetch.py [--steps 12]

FSDP2 prefetches the next unit's all-gather on CUDA streams; on CPU it has none, so it
issues each unit's all-gather in that unit's pre-forward and waits there. The experiment:
forward pre-hooks by which each unit (the root, then each block unit) issues the next
unit's all-gather with `FSDPModule.unshard(async_op=True)`, which gloo runs on its own
thread while the unit computes (FSDP2 waits for it in that unit's pre-forward). This builds
bench/peers.py's shape at dp 2 (twice its global batch: world 1's work per rank) for each
`dp_mode: shard` setup twice, without and with the hooks, plus `dp_mode: replicate`, in one
process pair, and steps them all in turn, step by step. Printed: tokens/s of each (median
step after the first) and the prefetch's ratio per setup. An experiment, not a dtensor3d
option (measured 0.95-1.05x: not taken).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARD = ["parallelism.dp=2", "parallelism.dp_mode=shard"]
NEVER = "parallelism.fsdp_reshard_after_forward=never"
SETUPS = {
    "shard": SHARD,
    "shard, never": [*SHARD, NEVER],
    "shard, never, bucket 2": [*SHARD, NEVER, "parallelism.fsdp_bucket_layers=2"],
}


def with_prefetch(apply_fsdp):
    """apply_fsdp, then the hooks: each unit's forward issues the next unit's all-gather."""

    def hook_for(following):
        def hook(_module, _args) -> None:
            following.unshard(async_op=True)

        return hook

    def applied(model, mesh, parallelism, policy=None):
        apply_fsdp(model, mesh, parallelism, policy)
        units = [model, *list(model.model.layers.values())[:: parallelism.fsdp_bucket_layers]]
        for unit, following in zip(units, units[1:]):
            unit.register_forward_pre_hook(hook_for(following))
        return model

    return applied


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
    import peers
    import torch
    import torch.distributed as dist

    from dtensor3d.parallel import parallelize

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    shape = {**peers.FULL, "batch": 2 * peers.FULL["batch"]}
    plain, runs = parallelize.apply_fsdp, {}
    for name, overrides in SETUPS.items():
        for prefetch in (False, True):
            parallelize.apply_fsdp = with_prefetch(plain) if prefetch else plain
            runs[(name, prefetch)] = peers.ours_steps(shape, overrides)
            next(runs[(name, prefetch)])  # built (and the first step run) with or without the hooks
    parallelize.apply_fsdp = plain
    runs[("replicate", None)] = peers.ours_steps(shape, ["parallelism.dp=2", "parallelism.dp_mode=replicate"])
    next(runs[("replicate", None)])
    times = peers.in_turn(runs, args.steps)
    if dist.get_rank() == 0:
        speed = {key: shape["batch"] * shape["seq"] / statistics.median(t) for key, t in times.items()}
        for name in SETUPS:
            off, on = speed[(name, False)], speed[(name, True)]
            print(f"{name:24s} prefetch off {off:8,.0f} tok/s  on {on:8,.0f} tok/s  x{on / off:.2f}", flush=True)
        print(f"{'replicate':24s} {speed[('replicate', None)]:8,.0f} tok/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
