"""`plan`: the layout of a recipe without launching anything."""

from __future__ import annotations

import json

from .mesh import AXES, rank_coords, rank_groups


def plan_dict(recipe, world_size: int | None = None) -> dict:
    dims = recipe.parallelism.dims
    world = world_size if world_size is not None else recipe.parallelism.world_size
    return {"world_size": world, "dims": dims, "groups": rank_groups(dims)}


def format_plan(recipe, as_json: bool) -> str:
    plan = plan_dict(recipe)
    if as_json:
        return json.dumps(plan)
    p, t = recipe.parallelism, recipe.training
    lines = [
        f"world size {plan['world_size']}: " + " ".join(f"{a}={p.dims[a]}" for a in AXES),
        f"pp_engine {p.pp_engine}, tp_mode {p.tp_mode}, dp_mode {p.dp_mode}, "
        f"{recipe.num_microbatches} microbatches of {t.micro_batch_size} x {t.sequence_length} tokens per dp rank",
        "",
        "rank  " + "  ".join(f"{a:>3}" for a in AXES),
    ]
    for rank, c in enumerate(rank_coords(p.dims)):
        lines.append(f"{rank:>4}  " + "  ".join(f"{c[a]:>3}" for a in AXES))
    lines.append("")
    for name, groups in plan["groups"].items():
        lines.append(f"{name:>8} groups: " + " ".join(str(g) for g in groups))
    return "\n".join(lines)
