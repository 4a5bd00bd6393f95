"""Where a tp 2 step's time goes, for transformers' tensor parallel and dtensor3d's two tp
modes (issue 25: the profile behind the "Peers" rows):

    torchrun --nproc-per-node 2 bench/tp_waits.py [--steps 6]

bench/peers.py's shape at tp 2, built three times in one process pair -- transformers'
`tp_plan="auto"` loop, dtensor3d ALL_REDUCE and dtensor3d REDUCE_SCATTER (the key off) --
and stepped in turn, step by step, each step under torch.profiler. Printed on rank 0, per
side (median over the steps after the first): the step's milliseconds, the milliseconds the
main thread spent in collectives (waiting for functional collectives, and in c10d's own
calls), the rest (compute and dispatch), and the
collectives' count per step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = {
    "dtensor3d ALL_REDUCE": ["parallelism.tp=2", "parallelism.tp_mode=ALL_REDUCE"],
    "dtensor3d REDUCE_SCATTER": ["parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER"],
}


def profiled(steps):
    """A step generator whose every step runs under torch.profiler: yields (step seconds,
    seconds in collectives, collectives waited for or called)."""
    from torch.profiler import ProfilerActivity, profile

    while True:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            seconds = next(steps)
        waits = [e for e in prof.key_averages() if _collective(e.key)]
        yield seconds, sum(e.self_cpu_time_total for e in waits) / 1e6, sum(e.count for e in waits)


def _collective(name: str) -> bool:
    """The main thread's time in collectives: funcol's waits and c10d's own calls (issuing;
    a synchronous one's whole run)."""
    return name == "_c10d_functional::wait_tensor" or name.startswith("c10d::")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
    import peers
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ckpt = peers.shared_checkpoint(peers.FULL)
    runs = {"transformers tp": profiled(peers.peer_steps("tp", peers.FULL, ckpt))}
    runs |= {name: profiled(peers.ours_steps(peers.FULL, o)) for name, o in OURS.items()}
    results = peers.in_turn(runs, args.steps)
    if dist.get_rank() == 0:
        for name, rows in results.items():
            step, wait, calls = (statistics.median(col) for col in zip(*rows[1:]))
            print(
                f"{name:26s} step {step * 1e3:7.1f} ms  in collectives {wait * 1e3:6.1f} ms  "
                f"rest {(step - wait) * 1e3:7.1f} ms  collectives {calls:4.0f}",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
