"""`plan --hardware NAME`: the predicted step time of a recipe on a device (hardware.py's
table), per pipeline rank, term by term, then tokens/s per GPU, MFU and the bound. Pure Python.

Per pp rank and step (m microbatches):
- compute: m x perf_compute.rank_seconds (matmuls by shape, attention, memory-bound ops;
  forward, backward, recompute);
- communication: plan's own byte counts (collectives.comm_bytes) turned into seconds per
  mesh dim -- a ring's wire bytes (all-gather (n-1) x piece, reduce-scatter and all-to-all
  (n-1)/n x input, all-reduce twice that, a send its bytes) over the group's bandwidth (its
  ranks within a node: NVLink; spread over nodes: the NICs of the k members a node holds,
  k x inter_node_gbps, at most NVLink's), at LINK_EFF, plus the collective latency per step of
  each call (call_steps: the entry's collective_steps) and, on a CPU entry, a wake-up per call
  (collective_wake_us: gloo's threads woken again between eager work);
- what of it is exposed, as the code runs it: tp's collectives sit between the matmuls
  (exposed; with tp_linear_async_communication overlapped with the matmuls, a chunk's share
  left); cp's K/V all-gather precedes attention (exposed); ep's all-to-alls are exposed but
  under dualpipev (its overlapped forward-backward pairs hide them behind the other
  microbatch's compute); pp's sends are exposed; FSDP's all-gathers are prefetched behind
  compute (resharded after forward: behind the whole step's compute; gathered once per step,
  under pp or `never`: behind the first microbatch's forward) and its reduce-scatter runs
  behind the last microbatch's backward, one unit's share always exposed;
- the pipeline: the busiest rank's busy time stretched by the schedule's bubble
  (schedule_model.bubble_fraction), then FSDP's exposed share and the optimizer step;
- a CPU entry (cores_per_node) whose node holds as many ranks as cores or more: the cores run
  every rank's work and its collectives' threads (a rank blocked in a collective or idle in the
  bubble gives its core away; with a core per rank, gloo's copies take core time from the other
  rank's compute: dp 2 on 2 cores measured 390-424 ms of core per rank in 422-446 ms steps), so
  the step is at least the node's summed core time over its cores (core_seconds:
  compute, host dispatch -- eager ops, tp's DTensor linears, FSDP2's hooks, the optimizer's
  DTensor parameters -- and the collectives' core time: the loopback's copies and each
  step's send and receive). Those host costs are the CPU entry's fields (hardware.yaml);
  a GPU's host runs ahead of it, so they are 0 there. Ranks taking turns on a core cost more
  core time each -- eager work x shared_core_factor (a switched-out rank's caches refilled), a
  collective step shared_collective_cpu_us (gloo's threads woken and switched in while the peer
  waits for a core) -- and leave the cores idle a share of the time (shared_idle: every rank
  blocked on a message in flight); all probed with a generic workload of 8 processes a core
  (perf.shared). Each call's wake-up costs its collective_wake_cpu_us of core at every share:
  the trainer's own ranks, measured, spend more core a step the more of them share a core.

Global constants (the only calibration): perf_compute.MATMUL_EFF, HBM_EFF, LINK_EFF here.
"""

from __future__ import annotations

import itertools
import math

from .collectives import comm_bytes
from .estimate import estimate, flops_per_step, resolve_reshard
from .memory import bubble_fraction
from .params import rank_parts, sizes
from .perf_compute import dense_peak, float8_on, optimizer_seconds, rank_seconds, tp_linears
from .reshard import hardware_bytes

LINK_EFF = 0.80  # share of a link's bandwidth NCCL's rings reach (nccl-tests bus bandwidth)
# Share of tp's communication async TP hides behind the matmuls: the decomposed GEMMs and
# the collectives contend for SMs and memory (PyTorch measured 1.09-1.16x over sync TP on
# Llama 3 8B / 70B, where tp is 20-30% of the step: about half of it hidden).
ASYNC_TP_HIDDEN = 0.5
AXIS_ORDER = ("ep", "pp", "dp", "cp", "tp")  # nanotron's rank matrix, tp fastest
GROUP_AXES = {"tp": ("tp",), "cp": ("cp",), "ep": ("ep",), "pp": ("pp",), "dp": ("ep", "dp", "cp"), "world": AXIS_ORDER}
LOSS_PARALLEL_CALLS = 4  # loss_parallel's all-reduces per microbatch (forward max, sum, target logit; backward)
WIRE = {"all_gather": None, "reduce_scatter": 1.0, "all_to_all": 1.0, "all_reduce": 2.0, "send_recv": 0.0}


def _members(dims: dict[str, int], axes) -> list[int]:
    """The ranks of the group along `axes` that holds rank 0."""
    strides, s = {}, 1
    for a in reversed(AXIS_ORDER):
        strides[a], s = s, s * dims[a]
    ranges = [range(0, dims[a] * strides[a], strides[a]) for a in axes]
    return sorted(sum(c) for c in itertools.product(*ranges))


def group_link(dims: dict[str, int], axes, hw, nodes: int, world: int) -> tuple[int, float]:
    """(group size, its bandwidth in bytes/s): within one node NVLink; across nodes, the k
    members one node holds share k NICs (at most NVLink's rate)."""
    ranks = _members(dims, axes)
    n, per_node = len(ranks), world // nodes
    k = sum(1 for r in ranks if r < per_node)
    if k >= n:
        return n, hw.intra_node_gbps * 1e9 * LINK_EFF
    return n, min(hw.intra_node_gbps, k * hw.inter_node_gbps) * 1e9 * LINK_EFF


def collective_seconds(kinds: dict[str, int], n: int, bandwidth: float, ring: bool = False) -> float:
    """Wire time of a dim's bytes (what one rank hands each kind) over a ring of n ranks (`ring`:
    gloo's algorithms, a reduce-scatter runs as an all-reduce of its input, Hardware.collective_steps)."""
    if n <= 1:
        return 0.0
    total = 0.0
    for kind, b in kinds.items():
        if kind == "total" or not b:
            continue
        factor = WIRE["all_reduce" if ring and kind == "reduce_scatter" else kind]
        if factor is None:  # all-gather: the rank's piece goes to n - 1 others
            wire = b * (n - 1)
        elif factor == 0.0:
            wire = b
        else:
            wire = factor * b * (n - 1) / n
        total += wire / bandwidth
    return total


def fsdp_units(recipe, part) -> int:
    """FSDP2's units on a pp rank: its layers in buckets of fsdp_bucket_layers, and the root."""
    return -(-len(part.layers) // recipe.parallelism.fsdp_bucket_layers) + 1


def _calls(recipe, part) -> dict[str, int]:
    """Collective calls per step and dim (latency), from the layers and the schedule."""
    p, m, mod = recipe.parallelism, recipe.num_microbatches, recipe.model
    layers = len(part.layers)
    moe = sum(1 for i in part.layers if mod.num_local_experts and mod.is_moe_layer(i))
    again = 1 + (p.recompute != "none") / 2
    units = fsdp_units(recipe, part)
    # tp: 4 a layer (8 with sequence parallelism), and per microbatch the vocab-parallel
    # embedding's one and loss_parallel's 4 (counted with torch's profiler: tp2 84 a step)
    tp = (8 if p.sequence_parallel else 4) * layers * m * again + m * (part.first + LOSS_PARALLEL_CALLS * part.last)
    return {
        "tp": int(tp) if p.tp_enabled else 0,
        "cp": int(2 * layers * m * again) if p.cp_enabled else 0,
        "ep": int(4 * moe * m * again) if p.ep_enabled else 0,
        "pp": 2 * m if p.pp_enabled else 0,
        "dp": units * (2 * m + 1 if p.reshard_after_forward else 2),
        "world": 2,
    }


def _comm_parts(recipe, hw, nodes: int) -> list[dict[str, tuple[float, int, int]]]:
    """Per pp rank and dim: (wire seconds per step, and on a CPU entry tp's calls x the host time
    DTensor's redistribution adds to each; collective steps per step, call_steps of each call;
    calls per step)."""
    p = recipe.parallelism
    dims, world = p.dims, p.world_size
    out = []
    ring = hw.collective_steps == "ring"
    for part, per_dim in zip(rank_parts(recipe), comm_bytes(recipe, "nccl")):
        calls, row = _calls(recipe, part), {}
        for dim, kinds in per_dim.items():
            n, bw = group_link(dims, GROUP_AXES[dim], hw, nodes, world)
            if dim == "pp":
                n = 2 if p.pp_enabled else 1
            split = kind_calls(recipe, part, dim, kinds, calls[dim])
            steps = sum(c * call_steps(hw, kind, n) for kind, c in split.items()) if n > 1 else 0
            host = calls[dim] * hw.dtensor_collective_us * 1e-6 if dim == "tp" and n > 1 else 0.0
            row[dim] = (collective_seconds(kinds, n, bw, ring) + host, steps, calls[dim] * (n > 1))
        out.append(row)
    return out


def call_steps(hw, kind: str, n: int) -> int:
    """Steps of one call of `kind` in a group of n (Hardware.collective_steps): ceil(log2 n); on a
    ring entry (gloo) an all-reduce's 2 (n - 1) -- a reduce-scatter's too, gloo runs it as one --,
    an all-gather's or all-to-all's n - 1, a send's 1."""
    if hw.collective_steps != "ring":
        return math.ceil(math.log2(max(n, 2)))
    return {"all_reduce": 2 * (n - 1), "reduce_scatter": 2 * (n - 1), "send_recv": 1}.get(kind, n - 1)


def kind_calls(recipe, part, dim: str, kinds: dict[str, int], calls: int) -> dict[str, float]:
    """A dim's `calls` per step by collective kind: tp's layer calls half all-gathers and half
    reduce-scatters under sequence parallelism (all-reduces otherwise) and the embedding's and
    loss_parallel's all-reduces; FSDP's one reduce-scatter per unit, its other calls all-gathers;
    the world's stats all-reduce (train.train_step) and step times' all-gather (metrics.py);
    elsewhere equal shares of the kinds the dim hands bytes to."""
    p, m = recipe.parallelism, recipe.num_microbatches
    present = [k for k in WIRE if kinds.get(k)]
    if not calls or not present:
        return {}
    if dim == "tp":
        edge = m * (part.first + LOSS_PARALLEL_CALLS * part.last)
        layer = calls - edge
        split = {"all_gather": layer / 2, "reduce_scatter": layer / 2} if p.sequence_parallel else {"all_reduce": layer}
        return split | {"all_reduce": split.get("all_reduce", 0) + edge}
    if dim == "dp" and present == ["all_gather", "reduce_scatter"]:
        units = fsdp_units(recipe, part)
        return {"all_gather": calls - units, "reduce_scatter": units}
    if dim == "world":
        return {"all_reduce": 1, "all_gather": calls - 1}
    return {k: calls / len(present) for k in present}


def comm_seconds(
    recipe, hw, nodes: int, per_step_us: float | None = None, per_call_us: float | None = None
) -> list[dict[str, float]]:
    """Per pp rank: seconds per step of each dim's collectives: wire time plus each step's
    latency and each call's wake-up (a CPU entry's collective_wake_us; `per_step_us` and
    `per_call_us`: other costs per step and call, the CPU entries' core time)."""
    us = hw.collective_latency_us if per_step_us is None else per_step_us
    wake = hw.collective_wake_us if per_call_us is None else per_call_us
    rows = _comm_parts(recipe, hw, nodes)
    return [{d: wire + (steps * us + calls * wake) * 1e-6 for d, (wire, steps, calls) in r.items()} for r in rows]


def _dp_exposed(recipe, comm: dict, compute: dict, units: int) -> float:
    """FSDP's / DDP's seconds per step not hidden behind compute (see the module's doc)."""
    p, m = recipe.parallelism, recipe.num_microbatches
    dp = comm["dp"]
    if not dp:
        return 0.0
    mb = sum(compute.values())
    if p.fsdp_enabled and p.reshard_after_forward:
        return max(0.0, dp - m * mb) + dp / units
    fwd, bwd = mb / 3, 2 * mb / 3  # a microbatch's forward and backward shares
    gather = dp * 0.2 if p.fsdp_enabled else 0.0  # bf16 gather: 2 of the 2 + 4 (+4 HSDP) bytes per parameter
    return max(0.0, gather - fwd) + max(0.0, dp - gather - bwd) + dp / units


def rank_terms(recipe, hw, part, comm: dict, params: int, fp8: bool, sac_matmuls: float = 0.0) -> dict:
    """One pp rank's terms per step (seconds)."""
    p, m = recipe.parallelism, recipe.num_microbatches
    mb = rank_seconds(recipe, hw, part, fp8, sac_matmuls)
    terms = {k: v * m for k, v in mb.items()}
    tp = comm["tp"]
    if p.tp_linear_async_communication and p.tp_enabled:
        tp = max(tp - terms["matmul_s"], tp * (1 - ASYNC_TP_HIDDEN))
    ep = comm["ep"]
    if p.pp_engine == "dualpipev" and p.pp_enabled:  # a forward's all-to-all behind another microbatch's backward
        ep = max(0.0, ep - sum(terms.values()))
    units = fsdp_units(recipe, part)
    if p.fsdp_enabled:  # FSDP2's hooks, each unit and microbatch (CPU: fsdp_unit_us)
        terms["host_s"] += m * units * hw.fsdp_unit_us * 1e-6
    terms |= {"tp_s": tp, "cp_s": comm["cp"], "ep_s": ep, "pp_s": comm["pp"]}
    terms["busy_s"] = sum(terms.values())
    terms["dp_s"] = comm["dp"]
    terms["dp_exposed_s"] = _dp_exposed(recipe, comm, mb, units)
    terms["optimizer_s"] = optimizer_seconds(params, hw, dtensor_params(recipe, part)) + comm["world"]
    return terms


def dtensor_params(recipe, part) -> int:
    """The parameter tensors a rank's optimizer steps as DTensors (FSDP or tp: 0 otherwise): a
    decoder layer's linears and two norms (a MoE layer's experts counted as a dense MLP's
    three), the embedding, the final norm and the head."""
    p = recipe.parallelism
    if not (p.fsdp_enabled or p.tp_enabled):
        return 0
    return len(part.layers) * (tp_linears(recipe, False) + 2) + part.first + 2 * part.last


def core_seconds(recipe, hw, nodes: int, rows: list[dict]) -> float:
    """A CPU entry (cores_per_node): the core time per step of the ranks one node holds, each
    pp rank's rows' compute and host time, its optimizer, and its collectives' core time (the
    loopback's copies -- the wire time -- each step's send and receive, collective_cpu_us, and each
    call's wake-up, collective_wake_cpu_us; a rank blocked in a collective or in the bubble uses no
    core: another rank runs). The wake-up is kept however many ranks share a core: 3d.yaml's model
    at dp x pp 2 x tp 2, 2 / 4 / 8 ranks a core (4, 8, 16 ranks), measured 66-75 / 72-97 / 87-110 ms
    of core per rank and step (main and gloo threads, /proc schedstat, 2026-12-06), where dropping it
    at 8 a core (the probe's lockstep pairs find the peer's message in) gave 67-73 / 69-75 / 66-69."""
    p = recipe.parallelism
    factor, _, share = shared(hw, p.world_size // nodes)
    at_8x = hw.shared_collective_cpu_us or hw.collective_cpu_us
    per_step = hw.collective_cpu_us + (at_8x - hw.collective_cpu_us) * share
    core = comm_seconds(recipe, hw, nodes, per_step, hw.collective_wake_cpu_us)
    work = 0.0
    stages = estimate(recipe, resolve=False)["stages"]
    for part, row, c, stage in zip(rank_parts(recipe), rows, core, stages):
        optimizer = optimizer_seconds(stage["params"], hw, dtensor_params(recipe, part))
        work += (sum(row[k] for k in COMPUTE) + optimizer) * factor + sum(c.values())
    return work * (p.world_size // nodes) / p.pp


def shared(hw, ranks: int) -> tuple[float, float, float]:
    """A CPU node whose `ranks` outnumber its cores: (what each rank's eager work's core time is
    multiplied by, the share of the cores left idle, the share of the way to the probe's 8 ranks
    a core), hardware_probe's shared_cores measured at 8 ranks a core, taken linearly in ranks per
    core from none at 1 (the probe's 1 x) to all at 8 and beyond. (1, 0, 0) on a GPU entry and
    where every rank has a core."""
    over = ranks / hw.cores_per_node if hw.cores_per_node else 1.0
    share = min(1.0, max(0.0, (over - 1) / 7))
    return 1 + (hw.shared_core_factor - 1) * share, hw.shared_idle * share, share


ADVICE = {
    "matmul_s": "compute-bound (matmuls): float8 (training.float8) or larger matmuls per rank (smaller tp)",
    "attention_s": "attention-bound: a faster attention kernel, or a shorter sequence per rank (more cp)",
    "memory_s": "memory-bound ops: training.compile=true fuses them; recompute selective/none recomputes less",
    "host_s": "host-bound (eager dispatch): training.compile=true, larger microbatches",
    "tp_s": "tensor-parallel communication: tp_linear_async_communication=true, a smaller tp, tp within a node",
    "cp_s": "context-parallel K/V exchange: a smaller cp, or cp within a node",
    "ep_s": "expert all-to-all: ep within a node, or pp_engine dualpipev (overlaps it)",
    "pp_s": "pipeline sends: fewer pipeline stages, or larger microbatches",
    "bubble_s": "pipeline bubble: more microbatches (a larger batch or smaller micro_batch_size), "
    "interleaved_1f1b / zbv / dualpipev, or a smaller pp",
    "dp_exposed_s": "data-parallel communication: larger fsdp_bucket_layers, fsdp_reshard_after_forward never, "
    "dp_mode hybrid (HSDP) within nodes",
    "optimizer_s": "the optimizer step: more ranks to shard it over (FSDP)",
    "shared_cores_s": "the node's ranks (and their collectives' threads) take every core: fewer ranks per node, "
    "or more cores",
}
COMPUTE = ("matmul_s", "attention_s", "memory_s", "host_s")


def predict(recipe, hw, nodes: int, float8: bool | None = None, sac_matmuls: float = 0.0) -> dict:
    """The whole prediction (`plan --json`'s key "performance"); `float8` stands in for
    training.float8 and `sac_matmuls` for a selective recompute policy that recomputes that
    share of the matmuls (published runs of other trainers, tests/plan/published_runs.yaml)."""
    recipe, reshard = resolve_reshard(recipe, hardware_bytes(hw, recipe, nodes))  # fsdp_reshard_after_forward auto
    p, t = recipe.parallelism, recipe.training
    fp8 = float8_on(recipe) if float8 is None else float8
    world = p.world_size
    est = estimate(recipe, resolve=False)
    comm = comm_seconds(recipe, hw, nodes)
    rows = []
    for part, c, row in zip(rank_parts(recipe), comm, est["stages"]):
        terms = rank_terms(recipe, hw, part, c, row["params"], fp8, sac_matmuls)
        rows.append({"stage": part.rank, **{k: round(v, 9) for k, v in terms.items()}})
    bubble = bubble_fraction(recipe)
    busy = max(r["busy_s"] for r in rows)
    # the busiest rank waits out the fill and drain of the others' work (equal ranks: busy / (1 - bubble))
    others = (sum(r["busy_s"] for r in rows) - busy) / (len(rows) - 1) if len(rows) > 1 else busy
    makespan = busy + bubble / (1 - bubble) * others
    tail = max(r["dp_exposed_s"] + r["optimizer_s"] for r in rows)
    core_bound = hw.cores_per_node and world // nodes >= hw.cores_per_node
    idle = shared(hw, world // nodes)[1]
    cores = core_seconds(recipe, hw, nodes, rows) / hw.cores_per_node / (1 - idle) if core_bound else 0.0
    step = max(makespan + tail, cores)
    tokens = t.global_batch_size * t.sequence_length
    flops = flops_per_step(recipe)
    slow = max(rows, key=lambda r: r["busy_s"])
    parts = {k: slow[k] for k in ("matmul_s", "attention_s", "memory_s", "host_s", "tp_s", "cp_s", "ep_s", "pp_s")}
    parts |= {"bubble_s": makespan - busy, "dp_exposed_s": slow["dp_exposed_s"], "optimizer_s": slow["optimizer_s"]}
    parts["shared_cores_s"] = max(0.0, step - makespan - tail)
    bound = max(parts, key=parts.get)
    return {
        "hardware": hw.name,
        "nodes": nodes,
        "gpus_per_node": world // nodes,
        "float8": fp8,
        "fsdp_reshard": reshard,
        "stages": rows,
        "bubble_fraction": bubble,
        "bubble_s": makespan - busy,
        "step_time_s": step,
        "breakdown_s": parts,
        "tokens_per_sec": tokens / step,
        "tokens_per_sec_per_gpu": tokens / step / world,
        "tflops_per_gpu": flops / step / world / 1e12,
        "mfu": flops / step / world / dense_peak(hw, sizes(recipe).compute),
        "bound": bound.removesuffix("_s"),
        "advice": ADVICE[bound],
        "constants": constants(),
    }


def constants() -> dict[str, float]:
    """The model's global constants (the only ones calibrated against measured runs)."""
    from . import perf_compute

    return {
        "MATMUL_EFF": perf_compute.MATMUL_EFF,
        "HBM_EFF": perf_compute.HBM_EFF,
        "LINK_EFF": LINK_EFF,
        "ASYNC_TP_HIDDEN": ASYNC_TP_HIDDEN,
    }
