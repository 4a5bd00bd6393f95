"""Build the dp_mode hybrid mesh for dp 4 = 2 x 2 (x tp 2 when asked) and print, for every
rank (gathered, printed by rank 0), the world ranks of its dp_replicate, dp_shard, dp,
dp_cp and tp groups and its coords."""

import json
import sys

import torch.distributed as dist

from dtensor3d.config.schema import ParallelismConfig
from dtensor3d.mesh import build_mesh, mesh_axis, mesh_coords

dist.init_process_group("gloo")
p = ParallelismConfig(dp=4, tp=int(sys.argv[1]), dp_mode="hybrid", dp_shard=2)
mesh = build_mesh(p, "cpu")
groups = {
    name: dist.get_process_group_ranks(mesh_axis(mesh, name).get_group())
    for name in ("dp_replicate", "dp_shard", "dp", "dp_cp", "tp")
}
rows = [None] * dist.get_world_size()
dist.all_gather_object(rows, {"rank": dist.get_rank(), "groups": groups, "coords": mesh_coords(mesh)})
if dist.get_rank() == 0:
    print("\n".join(json.dumps(row) for row in rows), flush=True)
dist.destroy_process_group()
