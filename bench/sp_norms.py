"""tp 2 REDUCE_SCATTER with its norms as torch's `SequenceParallel` (a DTensor dispatch per
op) against `SequenceShardNorm` (parallel/tensor.py: the same math on plain tensors), with
transformers' tp as the reference (issue 25):

    torchrun --nproc-per-node 2 bench/sp_norms.py [--steps 10]

bench/peers.py's shape at tp 2, the three setups built in one process pair and stepped in
turn, step by step; printed on rank 0: each one's median step after the first, tokens/s,
and its ratio to transformers' tp and to the SequenceParallel build.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SP = ["parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER"]


def built(steps):
    """The generator with its setup run (the first next() builds the model)."""
    next(steps)
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
    import peers
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import SequenceParallel

    from dtensor3d.parallel import tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ckpt = peers.shared_checkpoint(peers.FULL)
    runs = {"transformers tp": built(peers.peer_steps("tp", peers.FULL, ckpt))}
    ours, tensor.SequenceShardNorm = tensor.SequenceShardNorm, SequenceParallel
    runs["norms SequenceParallel"] = built(peers.ours_steps(peers.FULL, SP))
    tensor.SequenceShardNorm = ours
    runs["norms SequenceShardNorm"] = built(peers.ours_steps(peers.FULL, SP))
    step = {name: statistics.median(times[1:]) for name, times in peers.in_turn(runs, args.steps).items()}
    tokens = peers.FULL["batch"] * peers.FULL["seq"]
    if dist.get_rank() == 0:
        for name, s in step.items():
            print(
                f"{name:24s} step {s * 1e3:7.1f} ms  {tokens / s:8,.1f} tok/s  "
                f"vs transformers tp {step['transformers tp'] / s:5.3f}  "
                f"vs SequenceParallel {step['norms SequenceParallel'] / s:5.3f}",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
