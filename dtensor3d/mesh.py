"""The 5-D device mesh: (ep, pp, dp, cp, tp) in nanotron's order, tp varying fastest.

`rank_groups` is the pure rank table (no process group), used by `plan` and by tests;
`build_mesh` builds the real DeviceMesh with the same layout; `ParallelContext` is a
nanotron-shaped view over it for users moving scripts across.
"""

from __future__ import annotations

import math

import numpy as np

AXES = ("ep", "pp", "dp", "cp", "tp")
# Flattened views: name -> the axes it joins (in mesh order).
FLAT_VIEWS = {"dp_cp": ("dp", "cp"), "ep_dp_cp": ("ep", "dp", "cp")}


def rank_grid(dims: dict[str, int]) -> np.ndarray:
    """arange(world).reshape(ep, pp, dp, cp, tp): the rank at every mesh coordinate."""
    return np.arange(math.prod(dims[a] for a in AXES)).reshape([dims[a] for a in AXES])


def rank_groups(dims: dict[str, int], dp_shard: int | None = None) -> dict[str, list[list[int]]]:
    """Rank lists of every group (each axis and each flattened view), without a process group.
    With `dp_shard` (dp_mode: hybrid) also the HSDP groups: `dp_shard` (consecutive dp ranks
    that shard the parameters) and `dp_replicate` (the ranks holding the same shard)."""
    grid = rank_grid(dims)
    groups = {}
    for name, axes in [(a, (a,)) for a in AXES] + list(FLAT_VIEWS.items()):
        keep = [AXES.index(a) for a in axes]
        rest = [i for i in range(len(AXES)) if i not in keep]
        size = math.prod(dims[a] for a in axes)
        groups[name] = np.transpose(grid, rest + keep).reshape(-1, size).tolist()
    if dp_shard:
        ep, pp, dp, cp, tp = (dims[a] for a in AXES)
        split = grid.reshape(ep, pp, dp // dp_shard, dp_shard, cp, tp)
        groups["dp_replicate"] = np.moveaxis(split, 2, -1).reshape(-1, dp // dp_shard).tolist()
        groups["dp_shard"] = np.moveaxis(split, 3, -1).reshape(-1, dp_shard).tolist()
    return groups


def rank_coords(dims: dict[str, int]) -> list[dict[str, int]]:
    """rank -> {axis: coordinate}."""
    grid = rank_grid(dims)
    return [dict(zip(AXES, map(int, np.argwhere(grid == r)[0]))) for r in range(grid.size)]


# Under dp_mode hybrid (HSDP) the dp axis is built as two, dp_replicate x dp_shard (in that
# order, so a rank's dp coordinate is r * dp_shard + s, as in nanotron's matrix), and the
# views are made of those.
HYBRID_AXES = ("ep", "pp", "dp_replicate", "dp_shard", "cp", "tp")
HYBRID_VIEWS = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "ep_dp_cp": ("ep", "dp_replicate", "dp_shard", "cp"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "ep_dp_shard_cp": ("ep", "dp_shard", "cp"),
}


def mesh_views(mesh) -> dict[str, tuple[str, ...]]:
    return HYBRID_VIEWS if "dp_replicate" in (mesh.mesh_dim_names or ()) else FLAT_VIEWS


def build_mesh(parallelism, device_type: str):
    """A DeviceMesh named ("ep", "pp", "dp", "cp", "tp") plus the flattened views in FLAT_VIEWS
    (under dp_mode hybrid: HYBRID_AXES and HYBRID_VIEWS; `mesh_axis` reaches every name).

    `parallelism` is a ParallelismConfig. The default process group must exist (torchrun +
    init_process_group)."""
    from torch.distributed.device_mesh import init_device_mesh

    dims = dict(parallelism.dims)
    names, views = AXES, FLAT_VIEWS
    if parallelism.hsdp_enabled:
        dims.update(dp_replicate=parallelism.dp_replicate, dp_shard=parallelism.dp_shard)
        names, views = HYBRID_AXES, HYBRID_VIEWS
    mesh = init_device_mesh(device_type, tuple(dims[a] for a in names), mesh_dim_names=names)
    for name, axes in views.items():
        mesh[axes]._flatten(name)
    return mesh


def mesh_axis(mesh, name: str):
    """One axis of a mesh from `build_mesh`, or one of its flattened views. Flattening again
    returns the view made by build_mesh; slicing a flattened view out of the root mesh is
    deprecated in torch."""
    views = mesh_views(mesh)
    if name in views:
        return mesh[views[name]]._flatten(name)
    return mesh[name]


def mesh_coords(mesh) -> dict[str, int]:
    """This rank's coordinate on each of AXES (dp included under hybrid)."""
    return {a: mesh_axis(mesh, a).get_local_rank() for a in AXES}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device_type: str, timeout_s: float | None = None):
    """Join the default process group (or, outside torchrun, create a 1-process one);
    return this rank's device. gloo on CPU; nccl for CUDA tensors (gloo for CPU ones).
    timeout_s (training.timeout_s): how long the rendezvous waits for every rank and the
    default group's collectives wait for completion (None: torch's default, 30 min)."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        single = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        os.environ.update(single)
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=None if timeout_s is None else timedelta(seconds=timeout_s))
    return device


def set_timeout(seconds: float) -> None:
    """Give every process group this rank belongs to (the world, the mesh axes and views) the
    timeout (training.timeout_s): a collective that does not complete in time raises instead
    of hanging (training/faults.py turns that into one line)."""
    import contextlib
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    for group in list(c10d._world.pg_map):
        with contextlib.suppress(ValueError, RuntimeError, AssertionError):
            c10d._set_pg_timeout(timedelta(seconds=seconds), group)


class ParallelContext:
    """nanotron's ParallelContext, backed by a DeviceMesh.

    Exposes `tp_pg`, `pp_pg`, `dp_pg`, `cp_pg`, `ep_pg`, `dp_cp_pg` (ProcessGroups) and
    `world_ranks(axis)` / `<axis>_ranks` (the world ranks of this rank's group)."""

    def __init__(
        self,
        tensor_parallel_size: int,
        pipeline_parallel_size: int,
        data_parallel_size: int,
        context_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        backend: str | None = None,
    ):
        import torch
        import torch.distributed as dist

        from .config.schema import ParallelismConfig
        from .errors import EnvError

        p = ParallelismConfig(
            dp=data_parallel_size,
            tp=tensor_parallel_size,
            pp=pipeline_parallel_size,
            cp=context_parallel_size,
            ep=expert_parallel_size,
        )
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        init_distributed("cuda" if backend == "nccl" else "cpu")
        world = dist.get_world_size()
        if p.world_size != world:
            raise EnvError(f"ParallelContext: ep*pp*dp*cp*tp = {p.world_size} but the world size is {world}")
        self.parallelism = p
        self.device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        self.mesh = build_mesh(p, self.device_type)
        self.world_pg = dist.group.WORLD
        for name in list(AXES) + list(FLAT_VIEWS):
            setattr(self, f"{name}_pg", mesh_axis(self.mesh, name).get_group())
            setattr(self, f"{name}_ranks", dist.get_process_group_ranks(getattr(self, f"{name}_pg")))
        coords = self.mesh.get_coordinate()
        self.coords = dict(zip(AXES, coords))
        self.tensor_parallel_size, self.pipeline_parallel_size = p.tp, p.pp
        self.data_parallel_size, self.context_parallel_size = p.dp, p.cp
        self.expert_parallel_size = p.ep
        self.world_rank_matrix = rank_grid(p.dims)

    def world_ranks(self, axis: str) -> list[int]:
        return getattr(self, f"{axis}_ranks")

    def get_global_rank(self, ep_rank: int, pp_rank: int, dp_rank: int, cp_rank: int, tp_rank: int) -> int:
        return int(self.world_rank_matrix[ep_rank, pp_rank, dp_rank, cp_rank, tp_rank])

    def destroy(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
