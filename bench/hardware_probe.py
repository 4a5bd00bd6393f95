"""Measure this machine for plan's `cpu-gloo` hardware entry (dtensor3d/plan/hardware.yaml):

    python bench/hardware_probe.py

One thread (bench/throughput.py runs each rank with OMP_NUM_THREADS=1), fp32 (CPU training's
dtype): the matmul rate on the bench model's GEMM shapes, the streaming bandwidth of an
elementwise op, SDPA's attention kernel forward with backward, the per-op cost of eager
dispatch with autograd, the host time a tp-sharded linear adds (DTensor), gloo's latency,
core time and bandwidth between two local processes, and what 8 processes a core taking
turns cost (shared_cores). Prints the measured values beside the table's. Run it on a quiet
machine: another tenant's load inflates them.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml


def _best(fn, repeats: int = 7, clock=time.perf_counter) -> float:
    """The fastest of `repeats` timings of fn() (seconds) by `clock` (wall, or process time for a
    rank's core time): the machine is shared, the minimum is its own speed."""
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return min(times)


def matmul_gflops(dtype: torch.dtype = torch.float32) -> float:
    """A one-thread GEMM of the bench model's shape in `dtype` (float8: torch._scaled_mm, as
    torchao's Float8Linear runs it, into bf16), GFLOP/s."""
    a, b = torch.randn(1024, 256), torch.randn(704, 256).t()
    if dtype == torch.float8_e4m3fn:
        one, a8, b8 = torch.tensor(1.0), a.to(dtype), b.t().to(dtype).t()
        fn, n = lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 2
    else:
        a, b = a.to(dtype), b.contiguous().to(dtype)
        fn, n = (lambda: a @ b), (10 if dtype == torch.float32 else 2)  # a CPU's bf16 can be 30x slower
    s = _best(lambda: [fn() for _ in range(n)])
    return 2 * 1024 * 256 * 704 * n / s / 1e9


def stream_gbps() -> float:
    a = torch.randn(8 << 20)
    out = torch.empty_like(a)
    s = _best(lambda: torch.add(a, 1.0, out=out))
    return 2 * a.nbytes / s / 1e9


def attention_gflops(dtype: torch.dtype = torch.float32) -> float:
    """SDPA's CPU flash kernel, causal, forward with backward, at the bench model's attention
    (microbatch 2, 8 query and 4 key/value heads of 32, sequence 256), in plan's FLOPs
    (perf_compute._attention_flops: half the sequence seen, x3.5 for forward with backward), in `dtype`."""
    import torch.nn.functional as F

    b, h, kv, s, d = 2, 8, 4, 256, 32
    q = torch.randn(b, h, s, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, kv, s, d, dtype=dtype, requires_grad=True) for _ in range(2))

    def run():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()

    flops = 3.5 * 2 * (b * s) * (s / 2) * h * (2 * d)
    return flops / _best(run) / 1e9


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
    cpu = time.process_time()
    lat = statistics.median(_timed(lambda: dist.all_reduce(small)) for _ in range(200))
    cpu = (time.process_time() - cpu) / 200  # the core time of one step, this rank's (a blocked wait uses none)
    bw = statistics.median(_timed(lambda: dist.all_reduce(big)) for _ in range(10))
    dtensor = _dtensor_all_reduce_cpu(small)
    if rank == 0:
        with open(out, "w") as f:
            f.write(f"{lat} {bw} {cpu} {dtensor - cpu}")
    dist.destroy_process_group()


def _dtensor_all_reduce_cpu(t: torch.Tensor) -> float:
    """Core seconds of the same all-reduce issued as tp issues it: a DTensor's Partial ->
    Replicate redistribution (functional collective, its async wrapper and wait)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = init_device_mesh("cpu", (2,))

    def reduce():
        d = DTensor.from_local(t, mesh, [Partial()], run_check=False)
        d.redistribute(mesh, [Replicate()]).to_local().add_(0)  # waits for the collective

    reduce()
    start = time.process_time()
    for _ in range(200):
        reduce()
    return (time.process_time() - start) / 200


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def gloo_latency_and_gbps() -> tuple[float, float, float, float]:
    """(seconds of a 4-byte all-reduce, GB/s of a 4 MiB all-reduce's wire bytes, core seconds
    of the 4-byte all-reduce in one of the two processes, the core seconds DTensor adds to it)."""
    path, out = tempfile.mktemp(), tempfile.mktemp()
    mp.spawn(_gloo, args=(path, out), nprocs=2)
    lat, seconds, cpu, dtensor = map(float, open(out).read().split())
    os.unlink(out)
    wire = 2 * (1 << 22) * (2 - 1) / 2  # ring all-reduce: 2 (n - 1) / n of the tensor
    return lat, wire / (seconds - lat) / 1e9, cpu, dtensor


def _microbatch_cpu(model, ids, sharded: bool) -> float:
    """Core seconds of one forward and backward (the loss: loss_parallel where sharded)."""
    import contextlib

    from torch.distributed.tensor.parallel import loss_parallel

    def step():
        with loss_parallel() if sharded else contextlib.nullcontext():
            logits = model(ids[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()).backward()

    return _best_cpu(step)


def _bench_model(recipe, wrap=None):
    """The bench model on CPU, `wrap`ped (on the meta device) first."""
    from dtensor3d.models import build_on_meta, materialize
    from dtensor3d.models.layers import ModelHooks
    from dtensor3d.parallel.shards import init_weights
    from dtensor3d.parallel.tensor import vocab_layout

    model = build_on_meta(recipe.model, hooks=ModelHooks(vocab_layout=vocab_layout))
    if wrap is not None:
        wrap(model)
    model = materialize(model, "cpu")
    init_weights(model, 0)
    return model


NIL = ["model.hidden_size=16", "model.intermediate_size=32", "model.num_attention_heads=2"]
NIL += ["model.num_key_value_heads=1", "model.vocab_size=32", "model.max_position_embeddings=16"]
NIL += ["training.sequence_length=8", "training.micro_batch_size=1", "training.global_batch_size=1"]


def layer_host_us() -> tuple[float, float]:
    """(one eager decoder layer's host time, forward with backward; the embedding's, final norm's,
    head's and loss's), microseconds: microbatches of 1- and 3-layer models at a shape whose
    compute is nil (hidden 16, 8 tokens), where every microsecond is dispatch, autograd and the
    kernels' fixed costs."""
    from common import bench_recipe

    cpu = {}
    for layers in (1, 3):
        model = _bench_model(bench_recipe([*NIL, f"model.num_hidden_layers={layers}"], "cpu"))
        cpu[layers] = _microbatch_cpu(model, torch.randint(0, 32, (1, 9)), False)
    layer = (cpu[3] - cpu[1]) / 2
    return layer * 1e6, (cpu[1] - layer) * 1e6


def _optimizer_cpu(model) -> float:
    """Core seconds of one AdamW step over the model's parameters (gradients of ones)."""
    for q in model.parameters():
        q.grad = torch.ones_like(q)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return _best_cpu(opt.step)


def _best_cpu(fn, repeats: int = 5) -> float:
    return _best(fn, repeats, time.process_time)


SMALL = ["model.hidden_size=64"]  # 3d.yaml's width: host costs per call, few FLOPs


def wrapper_us() -> tuple[float, float]:
    """Host (core) time FSDP2 and DTensor parameters add on a one-rank mesh over the plain
    model (the bench model at 3d.yaml's widths, the same FLOPs): (FSDP2's hooks per unit and
    microbatch, its units each layer and the root, never resharded; AdamW per DTensor
    parameter), microseconds."""
    from common import bench_recipe
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    recipe = bench_recipe([*SMALL, "model.intermediate_size=176", "model.vocab_size=256"], "cpu")
    t, layers = recipe.training, recipe.model.num_hidden_layers
    ids = torch.randint(0, recipe.model.vocab_size, (t.micro_batch_size, t.sequence_length + 1))
    dp_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))

    def fsdp(model):
        for layer in model.model.layers.values():
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=False)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)

    plain, shard = _bench_model(recipe), _bench_model(recipe, fsdp)
    unit = (_microbatch_cpu(shard, ids, False) - _microbatch_cpu(plain, ids, False)) / (layers + 1)
    param = (_optimizer_cpu(shard) - _optimizer_cpu(plain)) / len(list(plain.parameters()))
    dist.destroy_process_group()
    return unit * 1e6, param * 1e6


def _tp_rank(rank: int, path: str, out: str) -> None:
    """One of two tp ranks: core seconds of a microbatch through the tp 2 model, and through a
    plain model of one tp rank's own widths (half the heads, intermediate and vocabulary)."""
    from common import bench_recipe
    from torch.distributed.device_mesh import init_device_mesh

    from dtensor3d.parallel.tensor import apply_tp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    full = bench_recipe([*SMALL, "model.intermediate_size=176", "model.vocab_size=256", "parallelism.tp=2"], "cpu")
    half = ["model.intermediate_size=88", "model.num_attention_heads=4", "model.num_key_value_heads=2"]
    half = bench_recipe([*SMALL, *half, "model.head_dim=8", "model.vocab_size=128"], "cpu")
    t = full.training
    ids = torch.randint(0, 128, (t.micro_batch_size, t.sequence_length + 1), generator=torch.Generator().manual_seed(0))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    sharded = _microbatch_cpu(_bench_model(full, lambda m: apply_tp(m, mesh, full.parallelism)), ids, True)
    own = _microbatch_cpu(_bench_model(half), ids, False)
    if rank == 0:
        with open(out, "w") as f:
            f.write(f"{sharded} {own}")
    dist.destroy_process_group()


def tp_linear_us(collective_s: float) -> float:
    """The host time a tp-sharded linear adds (forward with backward: DTensor wrapping, the
    ParallelStyle hooks, loss_parallel) on a real two-rank mesh: a tp 2 rank's microbatch less
    the same local compute as a plain model and less its collectives (4 a layer, the
    embedding's one, loss_parallel's 4, each `collective_s` of core time), per sharded linear.
    Microseconds."""
    from common import bench_recipe

    from dtensor3d.plan.perf import LOSS_PARALLEL_CALLS
    from dtensor3d.plan.perf_compute import tp_linears

    path, out = tempfile.mktemp(), tempfile.mktemp()
    mp.spawn(_tp_rank, args=(path, out), nprocs=2)
    sharded, own = map(float, open(out).read().split())
    os.unlink(out)
    recipe = bench_recipe(SMALL, "cpu")
    layers = recipe.model.num_hidden_layers
    host = sharded - own - (4 * layers + 1 + LOSS_PARALLEL_CALLS) * collective_s
    return host / (layers * tp_linears(recipe, False) + 2) * 1e6  # and the embedding, the head


def _step_rank(rank: int, path: str, out: str) -> None:
    """One of two tp ranks training the bench model at 3d.yaml's widths (train_step, 6 steps):
    the lowest core seconds a step spends outside forward, backward and AdamW's step (the
    gradients' placements, the norm's partial sum, the world all-reduce of loss and norm, the
    clip, the metrics), what AdamW's step adds over the same step on plain tensors of the
    local shapes, and its DTensor parameters."""
    from common import bench_recipe

    import dtensor3d.training.train as train
    from dtensor3d.datasets.sources import make_source

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    recipe = bench_recipe([*SMALL, "model.intermediate_size=176", "model.vocab_size=256", "parallelism.tp=2"], "cpu")
    inner = {"s": 0.0}

    def timed(fn):
        def run(*args, **kwargs):
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                inner["s"] += time.process_time() - start

        return run

    losses, train._losses = train._losses, timed(train._losses)
    state = train.setup(recipe)
    step, adamw = state.optimizer.step, []

    def optimizer_step(*args, **kwargs):
        start = time.process_time()
        try:
            return step(*args, **kwargs)
        finally:
            adamw.append(time.process_time() - start)
            inner["s"] += adamw[-1]

    state.optimizer.step = optimizer_step
    source, outside = make_source(recipe), []
    for i in range(6):
        batch, inner["s"] = train.rank_batch(state, source, i), 0.0
        start = time.process_time()
        train.train_step(state, batch)
        outside.append(time.process_time() - start - inner["s"])
    train._losses = losses
    dtensors = sum(1 for q in state.params if hasattr(q, "device_mesh"))
    extra = min(adamw[1:]) - _plain_adamw_cpu(state.optimizer)
    if rank == 0:
        with open(out, "w") as f:
            f.write(f"{min(outside[1:])} {extra} {dtensors}")
    dist.destroy_process_group()


def _plain_adamw_cpu(optimizer) -> float:
    """Core seconds of the same AdamW step (its groups and options) over plain tensors of the
    parameters' local shapes."""
    from dtensor3d.parallel.shards import local

    groups = []
    for group in optimizer.param_groups:
        params = [torch.zeros_like(local(q.detach())) for q in group["params"]]
        for q in params:
            q.grad = torch.ones_like(q)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    return _best_cpu(torch.optim.AdamW(groups).step)


def step_host_us(collective_s: float) -> tuple[float, float]:
    """On a real two-rank tp mesh, per DTensor parameter (microseconds): the core time a step
    spends outside forward, backward and AdamW's step, less its world all-reduce's
    (`collective_s` each, 2 steps: plan counts them) -- plan's dtensor_grad_us -- and what
    AdamW's step adds over plain tensors (dtensor_param_us)."""
    path, out = tempfile.mktemp(), tempfile.mktemp()
    mp.spawn(_step_rank, args=(path, out), nprocs=2)
    outside, adamw, dtensors = map(float, open(out).read().split())
    os.unlink(out)
    return (outside - 2 * collective_s) / dtensors * 1e6, adamw / dtensors * 1e6


def _pair_rank(rank: int, n: int, path: str, out: str, size: int = 2, kind: str = "all_reduce") -> None:
    """One of n processes in `size`-rank gloo groups (tp's pattern: pairs all-reducing; FSDP's:
    groups of 4 reduce-scattering): 100 times an eager unit (8 small matmuls with an activation,
    ~0.2 ms) then a 32 KiB collective of `kind` in its group. Rank 0 writes the means over the n
    processes of: the unit's core seconds (its thread's), the process's core seconds per iteration
    (gloo's threads too) and the wall seconds per iteration."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=n)
    group = [dist.new_group(list(range(i, i + size))) for i in range(0, n, size)][rank // size]
    x, w, t = torch.randn(128, 64), torch.randn(64, 64) / 8, torch.zeros(2 * 64 * 64)
    piece, unit = torch.zeros(t.numel() // size), [0.0]

    def collective() -> None:
        if kind == "reduce_scatter":
            dist.reduce_scatter_tensor(piece, t, group=group)
        else:
            dist.all_reduce(t, group=group)

    def iterate(times: int) -> None:
        for _ in range(times):
            start, y = time.thread_time(), x
            for _ in range(8):
                y = torch.nn.functional.silu(y @ w) + y
            unit[0] += time.thread_time() - start
            collective()

    iterate(10)
    dist.barrier()
    wall, core, unit[0] = time.perf_counter(), time.process_time(), 0.0
    iterate(100)
    per = torch.tensor([unit[0], time.process_time() - core, time.perf_counter() - wall]) / 100
    dist.all_reduce(per)  # the sums over the n processes
    if rank == 0:
        with open(out, "w") as f:
            f.write(" ".join(str(v / n) for v in per.tolist()))
    dist.destroy_process_group()


def shared_cores(cores: int, wire_s: float) -> tuple[float, float, float]:
    """The same per-process work (_pair_rank) by as many processes as cores and by 8 x as many,
    which take turns on the cores: (the eager unit's core time at 8 x over 1 x -- a switched-out
    process's caches refilled --, the core time of one 2-rank all-reduce at 8 x less its 32 KiB
    copy's `wire_s` -- gloo's threads woken and switched in while their peer waits for a core --,
    the share of the cores left idle at 8 x: every process blocked on a message in flight).
    Needs a quiet machine: another tenant's load inflates them."""
    measured = []
    for n in (2 * -(-cores // 2), 16 * -(-cores // 2)):
        path, out = tempfile.mktemp(), tempfile.mktemp()
        mp.spawn(_pair_rank, args=(n, path, out), nprocs=n)
        measured.append((n, *map(float, open(out).read().split())))
        os.unlink(out)
    (_, alone, _, _), (n, unit, core, wall) = measured
    return unit / alone, core - unit - wire_s, max(0.0, 1 - n * core / (cores * wall))


def interleaved_call(cores: int, wire_s: float) -> tuple[float, float]:
    """A 2-rank all-reduce as the trainer issues them, between eager units, with a core per
    process (_pair_rank's pattern, as many processes as cores): (its wall seconds, its core
    seconds), each beyond the unit and the 32 KiB copy's `wire_s`. Back to back (gloo_latency's
    loop) gloo's threads never sleep; between units each call wakes them and their waiter again,
    which costs several times the back-to-back figures."""
    n = 2 * -(-cores // 2)
    path, out = tempfile.mktemp(), tempfile.mktemp()
    mp.spawn(_pair_rank, args=(n, path, out), nprocs=n)
    unit, core, wall = map(float, open(out).read().split())
    os.unlink(out)
    return wall - unit - wire_s, core - unit - wire_s


def shared_reduce_scatter(cores: int, wire_s: float) -> float:
    """The check of the ring model (hardware.yaml's collective_steps): the same 8 processes a core
    in groups of 4 reduce-scattering the 32 KiB (FSDP's pattern): core seconds of one call, less
    the unit and the copies' `wire_s`. gloo runs it as an all-reduce: 6 ring steps, against the
    pair all-reduce's 2."""
    n = 16 * -(-cores // 2)
    path, out = tempfile.mktemp(), tempfile.mktemp()
    mp.spawn(_pair_rank, args=(n, path, out, 4, "reduce_scatter"), nprocs=n)
    unit, core, _ = map(float, open(out).read().split())
    os.unlink(out)
    return core - unit - wire_s


def measure(hw) -> dict[str, float]:
    """One pass of every probe: {hardware.yaml field: value, in the table's units} and, under
    names starting with `_`, the raw figures printed beside them. `hw`: the entry whose link
    bandwidth sizes the shared-core probes' copies."""
    from dtensor3d.plan.perf import LINK_EFF, call_steps
    from dtensor3d.plan.perf_compute import HBM_EFF, MATMUL_EFF

    gflops, gbps, op, attn = matmul_gflops(), stream_gbps(), op_overhead_us(), attention_gflops()
    bf16, fp8, bf16_attn = (
        matmul_gflops(torch.bfloat16),
        matmul_gflops(torch.float8_e4m3fn),
        attention_gflops(torch.bfloat16),
    )
    layer_host, outer_host = layer_host_us()
    fsdp_unit, one_rank_param = wrapper_us()
    lat, link, lat_cpu, dtensor_call = gloo_latency_and_gbps()
    tp_op = tp_linear_us(lat_cpu + dtensor_call)
    grad, dtensor_param = step_host_us(lat_cpu)  # on a real two-rank mesh (wrapper_us': one rank)
    link_s = 32768 / (hw.intra_node_gbps * 1e9 * LINK_EFF)
    factor, shared_call, idle = shared_cores(hw.cores_per_node, link_s)
    rs_call = shared_reduce_scatter(hw.cores_per_node, 2 * 3 / 4 * link_s)
    call_wall, call_core = interleaved_call(hw.cores_per_node, link_s)
    steps, peak = call_steps(hw, "all_reduce", 2), gflops / MATMUL_EFF / 1000  # a 2-rank all-reduce's steps
    bf16_peak = bf16 / MATMUL_EFF / 1000
    return {
        "bf16_tflops": bf16_peak, "fp8_tflops": fp8 / MATMUL_EFF / 1000, "fp32_tflops": peak,
        "hbm_gbps": gbps / HBM_EFF, "attention_fraction": bf16_attn / 1000 / bf16_peak,
        "fp32_attention_fraction": attn / 1000 / peak, "op_overhead_us": op,
        "layer_host_us": layer_host, "outer_host_us": outer_host, "tp_linear_us": tp_op,
        "fsdp_unit_us": fsdp_unit, "dtensor_param_us": dtensor_param, "dtensor_grad_us": grad,
        "collective_latency_us": lat * 1e6 / steps, "intra_node_gbps": link / LINK_EFF,
        "inter_node_gbps": link / LINK_EFF, "collective_cpu_us": lat_cpu * 1e6 / steps,
        "dtensor_collective_us": dtensor_call * 1e6, "collective_wake_us": (call_wall - lat) * 1e6,
        "collective_wake_cpu_us": (call_core - lat_cpu) * 1e6, "shared_core_factor": factor,
        "shared_collective_cpu_us": shared_call * 1e6 / steps, "shared_idle": idle,
        "_gflops": gflops, "_gbps": gbps, "_attn": attn, "_link": link, "_one_rank_param": one_rank_param,
        "_rs_call_us": rs_call * 1e6, "_call_wall_us": call_wall * 1e6, "_call_core_us": call_core * 1e6,
        "_rs_steps": call_steps(hw, "reduce_scatter", 4),
    }  # fmt: skip


WHAT = {  # field -> what the probe measured for it (one thread, fp32; the table's units)
    "fp32_tflops": "an fp32 GEMM of the bench model's shape / MATMUL_EFF, TFLOP/s",
    "bf16_tflops": "the same GEMM in bf16 / MATMUL_EFF",
    "fp8_tflops": "the same GEMM by torch._scaled_mm, float8 e4m3 into bf16 / MATMUL_EFF",
    "hbm_gbps": "an elementwise op's streaming / HBM_EFF, GB/s",
    "fp32_attention_fraction": "SDPA forward+backward in fp32, plan's FLOPs, share of fp32_tflops",
    "attention_fraction": "the same in bf16, share of bf16_tflops",
    "op_overhead_us": "an eager op with its backward",
    "layer_host_us": "an eager decoder layer's host time, forward with backward",
    "outer_host_us": "the embedding, final norm, head and loss's host time",
    "tp_linear_us": "what a tp-sharded linear adds (DTensor, the styles' hooks)",
    "fsdp_unit_us": "FSDP2's hooks per unit and microbatch",
    "dtensor_param_us": "what AdamW adds per DTensor parameter, two ranks",
    "dtensor_grad_us": "step bookkeeping per DTensor parameter",
    "collective_latency_us": "a gloo 4 B all-reduce's wall per ring step",
    "intra_node_gbps": "a gloo 4 MiB all-reduce's wire GB/s / LINK_EFF (inter_node_gbps the same)",
    "collective_cpu_us": "its core time per ring step, one process",
    "dtensor_collective_us": "what DTensor's redistribution adds to a call",
    "collective_wake_us": "a call between eager work: wall beyond back to back's",
    "collective_wake_cpu_us": "the same call's core beyond back to back's",
    "shared_core_factor": "8 processes a core: eager work's core time over a core each",
    "shared_collective_cpu_us": "8 processes a core: a 2-rank all-reduce's core per ring step",
    "shared_idle": "8 processes a core: the share of the cores left idle",
}


def report(m: dict[str, float], hw) -> None:
    """measure()'s figures beside the entry's (`hw`), with the ring model's check."""
    for field, what in WHAT.items():
        print(f"  {field:26s} {m[field]:10.4g}  (table {getattr(hw, field)})  {what}")
    print(f"  a one-thread matmul {m['_gflops']:.1f} GFLOP/s, streaming {m['_gbps']:.2f} GB/s,", end=" ")
    print(f"gloo {m['_link']:.2f} GB/s")
    print(f"  AdamW per DTensor parameter on a one-rank mesh {m['_one_rank_param']:.0f} us")
    rs_steps = m["_rs_steps"]  # a 4-rank reduce-scatter: gloo runs it as an all-reduce, 2 (n - 1) ring steps
    print(
        f"  8 processes a core: a 4-rank reduce-scatter's core {m['_rs_call_us']:.0f} us, {rs_steps} steps of", end=" "
    )
    pair = m["shared_collective_cpu_us"]
    print(f"{m['_rs_call_us'] / rs_steps:.1f} (the ring model's check: the pair's step {pair:.1f})")


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else the architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.machine()


def median_entry(passes: list[dict[str, float]], hw, name: str) -> dict:
    """A hardware.yaml entry of this machine: each probed field the median over the passes (each
    pass's figure its fastest timing), the rest (capacity, node size, step model) this machine's
    or `hw`'s."""
    fields = {k: statistics.median(p[k] for p in passes) for k in passes[0] if not k.startswith("_")}
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    # a field probed at 0 (shared_idle: no core left idle) is left out: the table's default, 0
    rounded = {k: round(v, 4 if v < 10 else 1) for k, v in fields.items() if round(v, 4) > 0}
    head = {"hbm_gb": round(memory), "gpus_per_node": hw.gpus_per_node, "cores_per_node": os.cpu_count()}
    source = (
        f"bench/hardware_probe.py --repeat {len(passes)} on {platform.node() or 'this machine'}"
        f" ({cpu_model()}, {os.cpu_count()} cores),"
        f" {time.strftime('%Y-%m-%d %H:%M %Z')}: each field the median over the passes of each pass's fastest timing"
    )
    return {name: {**head, **rounded, "collective_steps": hw.collective_steps, "source": source}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=1, help="passes of every probe; fields: the median over them")
    ap.add_argument("--write", metavar="FILE", help="write the medians as a hardware file (plan --hardware-file)")
    ap.add_argument("--name", default="cpu-probed", help="the written entry's name (default cpu-probed)")
    args = ap.parse_args()
    if args.repeat < 1:
        print(f"error: --repeat {args.repeat}: must be at least 1", file=sys.stderr)
        raise SystemExit(2)
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from dtensor3d.plan.hardware import lookup

    hw, passes = lookup("cpu-gloo"), []
    for i in range(args.repeat):
        passes.append(measure(hw))
        if args.repeat > 1:
            print(f"pass {i + 1} of {args.repeat} ({time.strftime('%H:%M:%S')}):", flush=True)
        report(passes[-1], hw)
    if args.repeat > 1:
        print(f"median over {args.repeat} passes (range):")
        for k in WHAT:
            values = [p[k] for p in passes]
            print(f"  {k:26s} {statistics.median(values):10.4g}  ({min(values):.4g}-{max(values):.4g})", end=" ")
            print(f"(table {getattr(hw, k)})")
    if args.write:
        with open(args.write, "w") as f:
            yaml.safe_dump(median_entry(passes, hw, args.name), f, sort_keys=False, width=100)
        print(f"wrote {args.write}: plan RECIPE --hardware-file {args.write} --hardware {args.name}")


if __name__ == "__main__":
    main()
