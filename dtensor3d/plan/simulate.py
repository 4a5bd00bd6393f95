"""`plan --simulate [--rank R]`: build the real parallelized model of one rank of a recipe's
mesh, with no hardware and no other processes, and count what that rank holds.

The rank joins torch's fake process group (every collective returns at once, nothing is
sent) at the recipe's world size; `mesh.build_mesh` makes the real DeviceMesh and
`parallel.parallelize.parallelize` -- the trainer's own entry point -- applies the
pipeline split, tp, ep and FSDP2 to a model on the meta device (shapes, no memory). What
FSDP2, DTensor and the pipeline split leave on this rank is then read off the parameters:
each local shape (`parallel.shards.param_layout`), the element count, the bytes of the
storage each parameter owns (FSDP2 pads every rank's dim-0 chunk to ceil(d0 / n) rows) and
the optimizer's state (plan/state_bytes.py's param_state_bytes: AdamW's two moments of
each local parameter in optimizer.state_dtype and one fp32 `step` per tensor; Muon's one buffer).

It imports torch (about 10-30 s on a loaded machine); `plan` without --simulate does not.
"""

from __future__ import annotations

from contextlib import contextmanager

from ..errors import RecipeError


def check_rank(recipe, rank: int) -> None:
    """--rank R must name a rank of the recipe's mesh (checked before torch is imported)."""
    world = recipe.parallelism.world_size
    if not 0 <= rank < world:
        raise RecipeError(f"plan --simulate --rank {rank}: the mesh has {world} ranks; valid: 0..{world - 1}")


def _cuts(q) -> tuple[list[int], int]:
    """A parameter's tp / ep piece (its shape cut by its Shard placements on the tp and ep
    mesh dims) and the ranks of the FSDP dims that cut that piece further."""
    from torch.distributed.tensor import Shard

    from ..parallel.shards import is_dtensor

    piece, group = list(q.shape), 1
    if not is_dtensor(q):
        return piece, group
    for dim, size, placement in zip(q.device_mesh.mesh_dim_names, q.device_mesh.shape, q.placements):
        if isinstance(placement, Shard) and dim in ("tp", "ep"):
            piece[placement.dim] //= size
        elif isinstance(placement, Shard):  # FSDP's dim-0 chunks (a _StridedShard over tp too)
            group *= size
    return piece, group


def _count(model, recipe) -> dict:
    """This rank's parameters: element count, owned storage bytes, optimizer state bytes
    (state_bytes.param_state_bytes on each real parameter: the recipe's state_dtype, 8-bit
    blocks where the piece keeps them, Muon's one buffer)."""
    from ..parallel.shards import local, param_layout
    from .muon_cost import is_muon
    from .state_bytes import param_state_bytes

    layout, muon = param_layout(model), recipe.optimizer.name == "muon"
    params = stored = nbytes = tensors = state = 0
    for name, q in model.named_parameters():
        t = local(q)
        size = t.element_size()
        own = t.untyped_storage().nbytes()  # FSDP2's padded chunk, or the tp / ep piece
        params, nbytes, tensors = params + t.numel(), nbytes + own, tensors + 1
        stored += own // size
        layout[name]["stored_numel"] = own // size
        piece, group = _cuts(q)
        state += param_state_bytes(recipe, list(q.shape), piece, group, t.numel(), muon and is_muon(name, q.shape))
    return {
        "params": params,
        "params_stored": stored,
        "param_bytes": nbytes,
        "optimizer_bytes": state,
        "tensors": tensors,
        "parameters": layout,
    }


@contextmanager
def _member_groups_only(rank: int):
    """DeviceMesh makes every group of every dim on every rank (new_group per group: 36,224
    calls at 16,384 ranks, a third of the simulation's time); the rank never uses a group it
    is not in, and the fake process group needs no other rank's agreement, so those return
    at once as non-members (what new_group returns them anyway)."""
    import torch.distributed.device_mesh as device_mesh
    from torch.distributed.distributed_c10d import GroupMember

    original = device_mesh.new_group

    def new_group(ranks=None, **kwargs):
        if ranks is not None and rank not in ranks:
            return GroupMember.NON_GROUP_MEMBER
        return original(ranks=ranks, **kwargs)

    device_mesh.new_group = new_group
    try:
        yield
    finally:
        device_mesh.new_group = original


def simulate(recipe, rank: int) -> dict:
    """Build rank `rank`'s model part under a fake process group; return what it holds
    (the JSON under `plan --json --simulate`'s key "simulate")."""
    check_rank(recipe, rank)
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..mesh import build_mesh, mesh_coords
    from ..parallel.parallelize import parallelize

    p = recipe.parallelism
    if dist.is_initialized():
        raise RuntimeError("simulate: this process already has a process group; call it from a fresh process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=p.world_size)
    try:
        with _member_groups_only(rank):
            mesh = build_mesh(p, "cpu")
            coords = mesh_coords(mesh)
            model = parallelize(recipe, mesh, coords, torch.device("meta"))
        out = {"rank": rank, "world_size": p.world_size, "coords": coords, "stage": coords["pp"]}
        out.update(_count(model, recipe))
    finally:
        dist.destroy_process_group()
    return out


def compare(sim: dict, est: dict) -> dict:
    """The simulated rank against the estimate of its stage: every rank of a stage stores the
    estimate's `params` (FSDP2's padded chunk) and the rank with the largest chunk holds
    exactly that many."""
    row = est["stages"][sim["stage"]]
    return {
        "estimate_params": row["params"],
        "estimate_param_bytes": row["param_bytes"],
        "agrees": sim["params_stored"] == row["params"] and sim["param_bytes"] == row["param_bytes"],
    }


def simulate_lines(sim: dict, size) -> list[str]:
    """The text `plan --simulate` prints after the plan; `size` formats bytes."""
    where = " ".join(f"{a} {c}" for a, c in sim["coords"].items())
    padded = sim["params_stored"] - sim["params"]
    verdict = "agrees" if sim["agrees"] else "DIFFERS"
    return [
        "",
        f"simulated rank {sim['rank']} of {sim['world_size']} ({where}):",
        "  its real parallelized model, built on the meta device under a fake process group",
        f"  parameters {sim['params']:,} in {sim['tensors']} tensors"
        + (f" (+{padded:,} FSDP2 padding stored)" if padded else "")
        + f", {size(sim['param_bytes'])}; optimizer state {size(sim['optimizer_bytes'])}",
        f"  estimate for stage {sim['stage']}: {sim['estimate_params']:,} parameters per rank, "
        f"{size(sim['estimate_param_bytes'])} -- {verdict}",
    ]


def format_simulate(recipe, rank: int, as_json: bool, peak: float | None = None, mfu: float = 0.4, perf=None) -> str:
    """`plan --simulate`: the plan (plan.py) with rank `rank` simulated, as text or JSON
    (the plan's keys and "simulate")."""
    import json

    from .report import _size, format_plan, plan_dict

    check_rank(recipe, rank)
    plan = plan_dict(recipe, peak=peak, mfu=mfu, perf=perf)
    sim = simulate(recipe, rank)
    sim.update(compare(sim, plan["estimate"]))
    if as_json:
        return json.dumps(plan | {"simulate": sim})
    return format_plan(recipe, False, peak=peak, mfu=mfu, perf=perf) + "\n" + "\n".join(simulate_lines(sim, _size))
