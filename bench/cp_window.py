"""Sliding-window attention under context parallelism, side by side at cp 2:

    python bench/cp_window.py [--steps 8] [--seq 1024] [--window 128] [--device cpu|cuda]

Two ranks (torchrun, started by this script) build two models of throughput.py's BENCH shape at
sequence `--seq`, one with full causal attention and one with a sliding window of `--window` on
every layer, and alternate train steps between them on the same batches (so both see the same
machine load); the median of each after the first two is reported, by wall time and by CPU time.
With the window shorter than a zigzag chunk (seq / 4 at cp 2) each rank all-gathers only the
last window - 1 keys and values of its two chunks (parallel/context.window_attention). A second
part times one layer's attention alone (forward + backward): full causal, the window through
the tails-only gather, and the window through the whole-sequence gather the full layers take
(the flash kernel, which skips the blocks the window masks), with the bytes each gathers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_side_by_side(args) -> dict:
    """{(name, clock): median seconds per step} for name "full"/"window", clock "wall"/"cpu"."""
    import torch
    from common import bench_recipe

    from dtensor3d.datasets.sources import make_source
    from dtensor3d.training.train import rank_batch, setup, train_step

    base = [f"training.sequence_length={args.seq}", f"model.max_position_embeddings={args.seq}", "parallelism.cp=2"]
    runs = {"full": base, "window": [*base, f"model.sliding_window={args.window}"]}
    states = {name: setup(bench_recipe(keys, args.device)) for name, keys in runs.items()}
    sources = {name: make_source(state.recipe) for name, state in states.items()}
    times: dict[tuple, list[float]] = {(n, c): [] for n in runs for c in ("wall", "cpu")}
    for step in range(2 * args.steps):
        name = ("full", "window")[step % 2]
        state = states[name]
        batch = rank_batch(state, sources[name], step // 2)
        wall, cpu = time.perf_counter(), time.process_time()
        train_step(state, batch)
        if args.device == "cuda":
            torch.cuda.synchronize()
        times[name, "wall"].append(time.perf_counter() - wall)
        times[name, "cpu"].append(time.process_time() - cpu)
    return {key: statistics.median(t[2:]) for key, t in times.items()}


def attention_alone(args, repeats: int = 12) -> dict:
    """{variant: median seconds} of one layer's cp attention forward + backward."""
    import torch
    import torch.distributed as dist

    from dtensor3d.parallel.context import cp_attention, flash_attention, gather_sequence, zigzag_positions

    cp, rank, group = 2, dist.get_rank(), dist.group.WORLD
    g = torch.Generator().manual_seed(rank)
    b, h, kv, d, local = 2, 8, 4, 32, args.seq // 2
    q, k, v = (torch.randn(b, n, local, d, generator=g).to(args.device).requires_grad_() for n in (h, kv, kv))
    q_pos, k_pos = zigzag_positions(args.seq, cp, rank), torch.cat([zigzag_positions(args.seq, cp, r) for r in (0, 1)])
    where = dict(group=group, q_pos=q_pos, k_pos=k_pos)

    def whole_gather(q, k, v):
        k, v = gather_sequence(k, group, 2), gather_sequence(v, group, 2)
        return flash_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, cp=cp, rank=rank, window=args.window)

    variants = {
        "full causal": lambda: cp_attention(q, k, v, **where),
        "window, tails gathered": lambda: cp_attention(q, k, v, **where, window=args.window),
        "window, whole gathered": lambda: whole_gather(q, k, v),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(repeats * len(variants)):
        name = list(variants)[i % len(variants)]
        start = time.perf_counter()
        variants[name]().sum().backward()
        times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t[2:]) for name, t in times.items()}


def worker(args) -> None:
    import torch

    torch.set_num_threads(1)
    med = train_side_by_side(args)
    alone = attention_alone(args)
    if int(os.environ["RANK"]) != 0:
        return
    tokens = 8 * args.seq
    print(f"train step, cp 2, {tokens} tokens, window {args.window} (median of {args.steps - 2}):")
    for clock in ("wall", "cpu"):
        full, win = med["full", clock], med["window", clock]
        print(f"  {clock:4s} full {1e3 * full:8.1f} ms, window {1e3 * win:8.1f} ms, window / full {win / full:.3f}")
    kv_bytes = 2 * 4 * 32 * 4  # k and v, 4 kv heads of 32, fp32, per token
    gathered = {"full causal": args.seq, "window, tails gathered": 2 * 2 * (args.window - 1)}
    gathered["window, whole gathered"] = args.seq
    print("one layer's attention alone (fwd + bwd, batch 2, 8 heads / 4 kv heads of 32):")
    for name, s in alone.items():
        mib = 2 * gathered[name] * kv_bytes / 2**20  # batch 2
        print(f"  {name:24s} {1e3 * s:8.2f} ms  (gathered k, v: {mib:.2f} MiB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", os.path.abspath(__file__)]
    flags = ["--worker", f"--steps={args.steps}", f"--seq={args.seq}", f"--window={args.window}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "bench")])}
    subprocess.run([*cmd, *flags, f"--device={args.device}"], check=True, env=env, cwd=ROOT)


if __name__ == "__main__":
    sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
    main()
