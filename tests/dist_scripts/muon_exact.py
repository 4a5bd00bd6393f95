"""Muon's owner-rank exchange (dtensor3d/training/muon_owners.py) against torch's
Newton-Schulz on the full matrix, bitwise, for the layouts dtensor3d builds: FSDP's Shard(0)
(and uneven), tp's column Shard(0) and row Shard(1), FSDP over tp (_StridedShard), HSDP's
Replicate x Shard, ep's experts (each expert alone) with FSDP inside, and a plain tensor.
Both Newton-Schulz dtypes (optimizer.muon_ns_dtype: bfloat16, float32: the pieces travel in it).
Prints one line per layout and "MUON EXACT <n> <dtype>" when every one is equal.

usage: torchrun --nproc_per_node=4 muon_exact.py
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from dtensor3d.training.muon_owners import newton_schulz, orthogonalise, plan_units

LAYOUTS = {
    "fsdp_shard0_uneven": ((13, 6), (Shard(0), Shard(0))),
    "tp_col_x_fsdp": ((12, 10), (Shard(0), Shard(1))),
    "fsdp_over_tp_strided": ((16, 10), (_StridedShard(0, split_factor=2), Shard(0))),
    "hsdp_replicate_x_shard": ((10, 12), (Replicate(), Shard(0))),
    "tp_row": ((8, 12), (Replicate(), Shard(1))),
    "experts_ep_x_fsdp": ((4, 6, 10), (Shard(0), Shard(1))),
    "experts_ep_only": ((4, 10, 6), (Shard(0), Replicate())),
}


def check(units, params: dict, fulls: dict, plain: torch.Tensor, mesh, dtype: torch.dtype) -> None:
    order = [*params.values(), plain]
    out = orthogonalise(units, {p: p.to_local() if isinstance(p, DTensor) else p for p in order}, 5, dtype)
    ok = 0
    for k, p in params.items():
        got = DTensor.from_local(out[p], mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
        full = fulls[k].to(dtype)
        want = (
            torch.stack([newton_schulz(m, True, 5, dtype) for m in full])
            if full.ndim == 3
            else newton_schulz(full, False, 5, dtype)
        )
        same = torch.equal(got, want)
        ok += same
        if dist.get_rank() == 0:
            print(f"{k} {dtype}: {'equal' if same else 'DIFFERENT'}", flush=True)
    ok += torch.equal(out[plain], newton_schulz(plain.to(dtype), False, 5, dtype))
    owners = sorted({u.owner for u in units})
    if dist.get_rank() == 0 and ok == len(LAYOUTS) + 1:
        print(f"MUON EXACT {ok} {dtype} owners {owners}", flush=True)


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    gen = torch.Generator().manual_seed(0)
    fulls = {k: torch.randn(shape, generator=gen) for k, (shape, _) in LAYOUTS.items()}
    params = {k: distribute_tensor(fulls[k], mesh, list(pl)) for k, (_, pl) in LAYOUTS.items()}
    plain = torch.randn(9, 7, generator=gen)
    order = [*params.values(), plain]
    units = plan_units(order)
    for dtype in (torch.bfloat16, torch.float32):  # optimizer.muon_ns_dtype: torch's bf16, or fp32
        check(units, params, fulls, plain, mesh, dtype)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
