"""On 4 gloo ranks: an MoE layer with its experts spread over ep ranks (ep 2 and ep 4)
against the same layer with all experts local, for a learned-looking random router and for
a router forced to send every token to the same experts (all of them on one ep rank).
Compares outputs, input gradients, router gradients and expert gradients; prints one JSON
line per case from rank 0 with the largest absolute errors over all ranks."""

import functools
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dtensor3d.config.schema import ModelConfig
from dtensor3d.models.layers import ModelHooks
from dtensor3d.models.moe import MoE
from dtensor3d.parallel.expert import ep_dispatch, shard_experts

dist.init_process_group("gloo")
world, rank = dist.get_world_size(), dist.get_rank()
cfg = ModelConfig(
    hidden_size=16, intermediate_size=24, num_local_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=8
)
for ep in (2, 4):
    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("rest", "ep"))["ep"]
    for forced in (False, True):
        torch.manual_seed(0)  # the same weights on every rank
        ref = MoE(cfg, ModelHooks(aux_loss_scale=0.01))
        for p in ref.parameters():
            torch.nn.init.normal_(p, std=0.3)
        if forced:
            torch.nn.init.zeros_(ref.gate.weight)  # uniform router: every token picks the same top-2
        hooks = ModelHooks(aux_loss_scale=0.01, expert_dispatch=functools.partial(ep_dispatch, group=mesh.get_group()))
        moe = MoE(cfg, hooks)
        moe.load_state_dict(ref.state_dict())
        shard_experts(moe, mesh)

        g = torch.Generator().manual_seed(1000 + rank)  # different tokens on every rank
        x = torch.randn(2, 12, 16, generator=g)
        w = torch.randn(2, 12, 16, generator=g)
        x_ref, x_ep = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_ref, out_ep = ref(x_ref), moe(x_ep)
        (out_ref * w).sum().backward()
        (out_ep * w).sum().backward()
        used = int((ref.last_load > 0).sum())

        # Expert gradients under ep sum every rank's tokens: compare with the summed reference.
        errs = [
            (out_ep - out_ref).abs().max(),
            (x_ep.grad - x_ref.grad).abs().max(),
            (moe.gate.weight.grad - ref.gate.weight.grad).abs().max(),
        ]
        for name in ("w1", "w2", "w3"):
            full = getattr(ref.experts, name).grad.clone()
            dist.all_reduce(full, group=mesh.get_group())
            mine = getattr(moe.experts, name).grad.to_local()
            errs.append((mine - full.chunk(ep)[mesh.get_local_rank()]).abs().max())
        errs = torch.stack(errs)
        dist.all_reduce(errs, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(
                json.dumps(
                    {
                        "ep": ep,
                        "forced": forced,
                        "experts_used": used,
                        "max_errors": [e.item() for e in errs],
                        "out_scale": out_ref.abs().max().item(),
                    }
                ),
                flush=True,
            )
dist.destroy_process_group()
