"""`plan`: the layout of a recipe and what a step costs each rank, without launching anything.

`plan_dict` is the JSON (`world_size`, `dims`, `groups`, `estimate`); `format_plan` the text.
The estimate is dtensor3d/estimate.py's (memory per stage, FLOPs, bytes per collective per
mesh dim, the pipeline bubble, and with a peak FLOP rate the step time and tokens/s).
"""

from __future__ import annotations

import json

from ..errors import RecipeError
from ..mesh import AXES, rank_coords, rank_groups

GPUS = {"A100": 312.0, "H100": 989.0, "H200": 989.0, "B200": 2250.0, "L40S": 362.0, "A10G": 125.0}  # dense bf16 TFLOP/s
TEXT_RANKS = 64  # above this world size the text elides the rank table and shows
TEXT_GROUPS = 4  # this many groups per dim


def peak_tflops(gpu: str | None, peak: float | None, mfu: float) -> float | None:
    """The peak TFLOP/s from `--gpu NAME` or `--peak-tflops X` (None: neither), checked."""
    if gpu is not None and peak is not None:
        raise RecipeError(f"plan: --gpu {gpu} and --peak-tflops {peak}: give one of them")
    if not 0 < mfu <= 1:
        raise RecipeError(f"plan: --mfu {mfu} must be in (0, 1], e.g. 0.4")
    if gpu is not None:
        match = [name for name in GPUS if name.lower() == gpu.lower()]
        if not match:
            raise RecipeError(f"plan: --gpu {gpu!r} is not known; valid: {', '.join(GPUS)} (or --peak-tflops X)")
        return GPUS[match[0]]
    if peak is not None and not peak > 0:
        raise RecipeError(f"plan: --peak-tflops {peak} must be a positive number of TFLOP/s")
    return peak


def plan_dict(recipe, world_size: int | None = None, peak: float | None = None, mfu: float = 0.4, perf=None) -> dict:
    """The JSON of `plan`; with `perf` = (Hardware, nodes) also "performance" (plan/perf.py)."""
    from .estimate import estimate, reshard_here, resolve_reshard
    from .reshard import hardware_bytes

    recipe, line = resolve_reshard(recipe, hardware_bytes(perf[0], recipe, perf[1])) if perf else reshard_here(recipe)
    dims = recipe.parallelism.dims
    world = world_size if world_size is not None else recipe.parallelism.world_size
    out = {
        "world_size": world,
        "dims": dims,
        "groups": rank_groups(dims, recipe.parallelism.dp_shard or None),
        "estimate": estimate(recipe, peak, mfu, resolve=False),
    }
    if line:
        out["fsdp_reshard"] = {
            "after_forward": recipe.parallelism.fsdp_reshard_after_forward,
            "bucket_layers": recipe.parallelism.fsdp_bucket_layers,
            "why": line,
        }
    if perf is not None:
        from .perf import predict

        out["performance"] = predict(recipe, *perf)
    return out


def _size(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _layout_lines(recipe, plan: dict) -> list[str]:
    p, t = recipe.parallelism, recipe.training
    lines = [
        f"world size {plan['world_size']}: " + " ".join(f"{a}={p.dims[a]}" for a in AXES),
        f"pp_engine {p.pp_engine}, tp_mode {p.tp_mode}, dp_mode {p.dp_mode}, "
        f"{recipe.num_microbatches} microbatches of {t.micro_batch_size} x {t.sequence_length} tokens per dp rank",
    ]
    if t.device == "cuda":
        lines.append("note: training.device is cuda: a planning recipe for GPUs, not for CPU training")
    lines += ["", "rank  " + "  ".join(f"{a:>3}" for a in AXES)]
    coords = rank_coords(p.dims) if p.world_size <= TEXT_RANKS else []
    for rank, c in enumerate(coords):
        lines.append(f"{rank:>4}  " + "  ".join(f"{c[a]:>3}" for a in AXES))
    if not coords:
        lines.append(f"({p.world_size} ranks; rank = arange(world).reshape(ep, pp, dp, cp, tp); --json lists groups)")
    lines.append("")
    shown = len(coords) or TEXT_GROUPS
    for name, groups in plan["groups"].items():
        more = f" ... ({len(groups)} groups)" if len(groups) > shown else ""
        lines.append(f"{name:>8} groups: " + " ".join(str(g) for g in groups[:shown]) + more)
    return lines


def _span(layers: list[int]) -> str:
    """A stage's layers as text: "0-1", "2" (one layer) or "-" (none)."""
    if not layers:
        return "-"
    return str(layers[0]) if layers[0] == layers[1] else f"{layers[0]}-{layers[1]}"


def _estimate_lines(recipe, est: dict) -> list[str]:
    p = recipe.parallelism
    lines = [
        "",
        f"estimate per rank (params, grads and AdamW in fp32, compute in {recipe.training.dtype}, "
        f"recompute {p.recompute}):",
        f"{'stage':>5}  {'layers':<8} {'params':>13}  {'param mem':>10}  {'grads':>10}  {'optimizer':>10}  "
        f"{'activations (in flight)':>29}  {'peak':>10}",
    ]
    for s in est["stages"]:
        span = ",".join(_span(r) for r in s["stage_layers"]) or "-"
        lines.append(
            f"{s['stage']:>5}  {span:<8} {s['params']:>13,}  {_size(s['param_bytes']):>10}  "
            f"{_size(s['grad_bytes']):>10}  {_size(s['optimizer_bytes']):>10}  "
            f"{_size(s['activation_bytes']):>22} ({s['microbatches_in_flight']:>4})  {_size(s['peak_bytes']):>10}"
        )
    lines.append(
        f"flops per step {est['flops_per_step']:.3e}; pipeline bubble {100 * est['bubble_fraction']:.1f}% "
        f"({p.pp_engine})"
    )
    if recipe.data.document_masking:
        lines.append(
            "document masking: attention FLOPs counted in full (not modelled: SDPA applies the mask inside full causal "
            "attention and saves none; under cp the CPU flash kernel skips the keys no query of a chunk sees)"
        )
    lines.append("bytes one rank hands to collectives per step, by mesh dim (the busiest stage):")
    for dim, kinds in est["comm_bytes_per_step"].items():
        parts = ", ".join(f"{k} {_size(n)}" for k, n in kinds.items() if n and k != "total")
        lines.append(f"  {dim:>5} {_size(kinds['total']):>10}" + (f"  ({parts})" if parts else ""))
    if "step_time_s" in est:
        lines.append(
            f"step time {est['step_time_s']:.4g} s, {est['tokens_per_sec']:,.0f} tokens/s "
            f"at {est['peak_tflops']:g} TFLOP/s x MFU {est['mfu']:g} x {p.world_size} ranks"
        )
    return lines


def format_plan(recipe, as_json: bool, peak: float | None = None, mfu: float = 0.4, perf=None) -> str:
    plan = plan_dict(recipe, peak=peak, mfu=mfu, perf=perf)
    if as_json:
        return json.dumps(plan)
    lines = _layout_lines(recipe, plan) + _estimate_lines(recipe, plan["estimate"])
    if "fsdp_reshard" in plan:
        lines.insert(2, plan["fsdp_reshard"]["why"])
    if "performance" in plan:
        from .perf_report import performance_lines

        lines += performance_lines(recipe, plan["performance"])
    return "\n".join(lines)
