"""tp_linear_async_communication off and on, side by side (issue 25):

    python bench/async_tp.py [--steps 4] [--quick]

Two CPU ranks (gloo, one thread each) train bench/peers.py's shape at tp 2 in both tp modes,
the key off then on, in the same processes. Per step, parallel/comm.py's counter reports the
seconds the main thread waited on tp collectives, how many it issued and how many a matmul
ran behind (issued before it, waited for after). Printed: the median step's tokens/s and wait.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from peers import FULL, QUICK, recipe_for

    from dtensor3d.datasets.sources import make_source
    from dtensor3d.parallel.comm import count_step
    from dtensor3d.training.train import rank_batch, setup, train_step

    torch.set_num_threads(1)
    shape = QUICK if args.quick else FULL
    for mode in ("ALL_REDUCE", "REDUCE_SCATTER"):
        for key in ("false", "true"):
            overrides = ["parallelism.tp=2", f"parallelism.tp_mode={mode}"]
            state = setup(recipe_for(shape, [*overrides, f"parallelism.tp_linear_async_communication={key}"]))
            source, rows = make_source(state.recipe), []
            for step in range(args.steps):
                batch = rank_batch(state, source, step)
                start = time.perf_counter()
                with count_step(state.mesh) as counter:
                    train_step(state, batch)
                issued = sum(counter.issued["tp"].values())
                rows.append((time.perf_counter() - start, counter.wait_s["tp"], issued, counter.overlapped["tp"]))
            step_s, wait_s = (statistics.median(r[i] for r in rows[1:]) for i in (0, 1))
            if dist.get_rank() == 0:
                tokens = shape["batch"] * shape["seq"]
                over = ", ".join(f"{k} {v}" for k, v in rows[-1][3].items())
                print(
                    f"{mode:14s} async {key:5s} {tokens / step_s:8.0f} tok/s  {1000 * step_s:7.0f} ms/step  "
                    f"tp wait {1000 * wait_s:6.0f} ms  tp collectives {rows[-1][2]} (overlapped: {over or 'none'})",
                    flush=True,
                )
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, "--worker"]
    cmd += ["--steps", str(args.steps)] + ["--quick"] * args.quick
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "bench")]))
    print("tp 2, 2 CPU ranks, one thread each; median of steps 2..; wait and counts under comm.py's counter")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    print(proc.stdout, end="")
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
