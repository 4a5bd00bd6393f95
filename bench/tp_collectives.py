"""What sequence parallelism's collectives cost against ALL_REDUCE's, side by side (issue 25):

    python bench/tp_collectives.py [--rounds 5] [--iters 20]

Two ranks (gloo on CPU, NCCL with --device cuda), one thread each. For each size of a tp
region's activation (micro-batch x sequence x hidden, fp32), the same process pair times
what tp ALL_REDUCE issues per region (one all-reduce of the whole tensor) against what
REDUCE_SCATTER (sequence parallelism) issues (a reduce-scatter to the sequence shard and an
all-gather back), alternating the three collectives in every round; best round of each.
Printed: the times and the ratios reduce-scatter / all-reduce and (reduce-scatter +
all-gather) / all-reduce: above 1, sequence parallelism's communication costs more than the
all-reduce it replaces on that backend, whatever its memory saving.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

# micro-batch x sequence x hidden of bench/peers.py's shape (2 x 256 x 256) and around it
SIZES = ((2, 256, 128), (2, 256, 256), (2, 256, 512), (2, 1024, 512))


def timed(fn, iters: int) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def one_size(shape: tuple[int, ...], device: str, args) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    full = torch.randn(*shape, device=device)
    shard = torch.empty(shape[0] * shape[1] // world, shape[2], device=device)
    gathered = torch.empty(shape[0] * shape[1], shape[2], device=device)
    flat = full.view(-1, shape[2])
    ops = {
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, flat),
        "all_gather": lambda: dist.all_gather_into_tensor(gathered, shard),
    }
    best = dict.fromkeys(ops, float("inf"))
    for _ in range(args.rounds):
        for key, fn in ops.items():
            best[key] = min(best[key], timed(fn, args.iters))
            if device == "cuda":
                torch.cuda.synchronize()
    return best


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = args.device
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(dist.get_rank())
    for shape in SIZES:
        t = one_size(shape, device, args)
        if dist.get_rank() == 0:
            kib = torch.Size(shape).numel() * 4 // 1024
            rs, both = t["reduce_scatter"] / t["all_reduce"], (t["reduce_scatter"] + t["all_gather"]) / t["all_reduce"]
            times = "  ".join(f"{k} {1000 * v:6.2f} ms" for k, v in t.items())
            print(f"{'x'.join(map(str, shape)):>12s} {kib:6d} KiB  {times}  rs/ar {rs:4.2f}  (rs+ag)/ar {both:4.2f}")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, "--worker"]
    cmd += ["--rounds", str(args.rounds), "--iters", str(args.iters), "--device", args.device]
    print(f"2 ranks ({'NCCL' if args.device == 'cuda' else 'gloo'}), one thread each; best of {args.rounds} rounds")
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    print(proc.stdout, end="")
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])


if __name__ == "__main__":
    main()
