"""Measure this machine for plan's `cpu-gloo` hardware entry (dtensor3d/plan/hardware.yaml):

    python bench/hardware_probe.py

One thread (bench/throughput.py runs each rank with OMP_NUM_THREADS=1), fp32 (CPU training's
dtype): the matmul rate on the bench model's GEMM shapes, the streaming bandwidth of an
elementwise op, the per-op cost of eager dispatch with autograd, and gloo's latency and
bandwidth between two local processes. Prints the measured values beside the table's.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _best(fn, repeats: int = 7) -> float:
    """The fastest of `repeats` timings of fn() (seconds): the machine is shared, the minimum is its own speed."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_gflops() -> float:
    a, b = torch.randn(1024, 256), torch.randn(256, 704)
    n = 10
    s = _best(lambda: [a @ b for _ in range(n)])
    return 2 * 1024 * 256 * 704 * n / s / 1e9


def stream_gbps() -> float:
    a = torch.randn(8 << 20)
    out = torch.empty_like(a)
    s = _best(lambda: torch.add(a, 1.0, out=out))
    return 2 * a.nbytes / s / 1e9


def op_overhead_us() -> float:
    """Forward and backward of one small op under autograd, per op."""
    x = torch.randn(64, requires_grad=True)

    def run():
        y = x
        for _ in range(200):
            y = y * 1.0001
        y.sum().backward()

    return _best(run) / 200 * 1e6


def _gloo(rank: int, path: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    small, big = torch.zeros(1), torch.zeros(1 << 20)  # 4 B and 4 MiB
    for t in (small, big):
        dist.all_reduce(t)
    lat = statistics.median(_timed(lambda: dist.all_reduce(small)) for _ in range(200))
    bw = statistics.median(_timed(lambda: dist.all_reduce(big)) for _ in range(10))
    if rank == 0:
        with open(out, "w") as f:
            f.write(f"{lat} {bw}")
    dist.destroy_process_group()


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def gloo_latency_and_gbps() -> tuple[float, float]:
    """(seconds of a 4-byte all-reduce, GB/s of a 4 MiB all-reduce's wire bytes) between two processes."""
    path, out = tempfile.mktemp(), tempfile.mktemp()
    mp.spawn(_gloo, args=(path, out), nprocs=2)
    lat, seconds = map(float, open(out).read().split())
    os.unlink(out)
    wire = 2 * (1 << 22) * (2 - 1) / 2  # ring all-reduce: 2 (n - 1) / n of the tensor
    return lat, wire / (seconds - lat) / 1e9


def main() -> None:
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from dtensor3d.plan.hardware import lookup
    from dtensor3d.plan.perf_compute import HBM_EFF, MATMUL_EFF

    hw = lookup("cpu-gloo")
    gflops, gbps, op = matmul_gflops(), stream_gbps(), op_overhead_us()
    lat, link = gloo_latency_and_gbps()
    print(f"matmul {gflops:.1f} GFLOP/s -> peak {gflops / MATMUL_EFF / 1000:.4f} TFLOP/s (table {hw.bf16_tflops})")
    print(f"stream {gbps:.2f} GB/s -> hbm_gbps {gbps / HBM_EFF:.2f} (table {hw.hbm_gbps})")
    print(f"eager op forward+backward {op:.1f} us (table op_overhead_us {getattr(hw, 'op_overhead_us', None)})")
    print(f"gloo 4 B all-reduce {lat * 1e6:.0f} us (table {hw.collective_latency_us}); 4 MiB: {link:.2f} GB/s")


if __name__ == "__main__":
    main()
