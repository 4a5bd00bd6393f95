"""Run under torchrun with 8 gloo ranks: report every group of some real DeviceMeshes and of a
ParallelContext, so tests/parallel/test_mesh.py can compare them with the pure `rank_groups`.

    python -m torch.distributed.run --standalone --nproc_per_node 8 mesh_groups.py OUT.json

Rank 0 writes OUT.json: {"meshes": {name: {"dims": ..., "ranks": [per-rank report]}},
"context": [per-rank report]}.
"""

import json
import sys

import torch
import torch.distributed as dist

from dtensor3d.config.schema import ParallelismConfig
from dtensor3d.mesh import AXES, FLAT_VIEWS, ParallelContext, build_mesh

MESHES = {
    "ep1_pp2_dp2_cp1_tp2": ParallelismConfig(pp=2, dp=2, tp=2),
    "dp2_cp2_tp2": ParallelismConfig(dp=2, cp=2, tp=2),
    "ep2_pp2_cp2": ParallelismConfig(ep=2, pp=2, cp=2),
}


def mesh_report(parallelism) -> dict:
    mesh = build_mesh(parallelism, "cpu")
    names = list(AXES) + list(FLAT_VIEWS)
    return {
        "coordinate": list(mesh.get_coordinate()),
        "groups": {n: dist.get_process_group_ranks(mesh[n].get_group()) for n in names},
    }


def bitmask_sum(group) -> int:
    """all_reduce(1 << rank) over `group`: the result's set bits are exactly its members."""
    t = torch.tensor([1 << dist.get_rank()], dtype=torch.int64)
    dist.all_reduce(t, group=group)
    return int(t.item())


def context_report() -> dict:
    # nanotron's "validate your 3-D setup" snippet, on our ParallelContext.
    pc = ParallelContext(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2)
    c = pc.coords
    return {
        "tp_pg": dist.get_process_group_ranks(pc.tp_pg),
        "pp_pg": dist.get_process_group_ranks(pc.pp_pg),
        "dp_pg": dist.get_process_group_ranks(pc.dp_pg),
        "tp_ranks": pc.tp_ranks,
        "pp_ranks": pc.pp_ranks,
        "dp_ranks": pc.dp_ranks,
        "tp_sum": bitmask_sum(pc.tp_pg),
        "pp_sum": bitmask_sum(pc.pp_pg),
        "dp_sum": bitmask_sum(pc.dp_pg),
        "world_sum": bitmask_sum(pc.world_pg),
        "coords": {a: int(c[a]) for a in AXES},
        "global_rank": int(pc.get_global_rank(c["ep"], c["pp"], c["dp"], c["cp"], c["tp"])),
        "sizes": [
            pc.tensor_parallel_size,
            pc.pipeline_parallel_size,
            pc.data_parallel_size,
            pc.context_parallel_size,
            pc.expert_parallel_size,
        ],
    }


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    report = {"meshes": {}, "rank": dist.get_rank(), "world": dist.get_world_size()}
    for name, parallelism in MESHES.items():
        report["meshes"][name] = mesh_report(parallelism)
    report["context"] = context_report()
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(report, gathered, dst=0)
    if dist.get_rank() == 0:
        out = {"dims": {n: p.dims for n, p in MESHES.items()}, "ranks": gathered}
        with open(out_path, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
