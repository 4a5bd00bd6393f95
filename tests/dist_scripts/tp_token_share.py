"""On 2 gloo ranks (tp 2): an MoE layer (router, 8 experts top-2, a shared expert) with each
tp rank routing its share of the tokens (parallel/expert.TpTokenShare), ALL_REDUCE (the
replicated tokens split in two, outputs all-gathered) and REDUCE_SCATTER (each rank's
sequence shard), against the same layer on one device with all the tokens. Counts the
token slots each rank sent to its experts (the router's bincount: what the experts compute)
and compares outputs, input gradients and parameter gradients (summed over tp as the
trainer does: expert.sum_tp_grads). Prints one JSON line per mode from rank 0."""

import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dtensor3d.config.schema import ModelConfig, ParallelismConfig
from dtensor3d.models.layers import ModelHooks
from dtensor3d.models.moe import MoE
from dtensor3d.parallel.expert import TpTokenShare, sum_tp_grads

dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
cfg = ModelConfig(
    hidden_size=16, intermediate_size=24, num_local_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=8
)
batch, seq = 2, 12
for mode in ("ALL_REDUCE", "REDUCE_SCATTER"):
    torch.manual_seed(0)  # the same weights on every rank
    ref = MoE(cfg, ModelHooks(aux_loss_scale=0.01))
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.3)
    share = TpTokenShare(mesh, sequence_parallel=mode == "REDUCE_SCATTER")
    moe = MoE(cfg, ModelHooks(aux_loss_scale=0.01, tokens=share))
    moe.load_state_dict(ref.state_dict())

    g = torch.Generator().manual_seed(1000)  # the same tokens on both ranks (replicated over tp)
    x, w = torch.randn(batch, seq, 16, generator=g), torch.randn(batch, seq, 16, generator=g)
    x_ref, x_tp = x.clone().requires_grad_(), x.clone()
    if share.sequence_parallel:  # this rank's sequence shard, as the tp plan hands it over
        x_tp, w_tp = x_tp[:, rank * seq // 2 : (rank + 1) * seq // 2], w[:, rank * seq // 2 : (rank + 1) * seq // 2]
    else:
        w_tp = w
    x_tp = x_tp.contiguous().requires_grad_()
    (ref(x_ref) * w).sum().backward()
    out = moe(x_tp)
    (out * w_tp).sum().backward()
    sum_tp_grads(moe, ParallelismConfig(tp=2, tp_mode=mode), mesh)

    want_out = ref(x_ref.detach())
    want_dx = x_ref.grad
    if share.sequence_parallel:
        want_out = want_out[:, rank * seq // 2 : (rank + 1) * seq // 2]
        want_dx = want_dx[:, rank * seq // 2 : (rank + 1) * seq // 2]
    err = {
        "out": (out - want_out).abs().max().item(),
        "dx": (x_tp.grad - want_dx).abs().max().item(),
        "params": max((a.grad - b.grad).abs().max().item() for a, b in zip(moe.parameters(), ref.parameters())),
        "aux": (moe.last_aux - ref.last_aux).abs().item(),
    }
    sent = torch.tensor([moe.last_load.sum().item(), ref.last_load.sum().item()])
    slots = [torch.zeros(2) for _ in range(2)]
    dist.all_gather(slots, sent)
    errs = [None, None]
    dist.all_gather_object(errs, err)
    if rank == 0:
        worst = {k: max(e[k] for e in errs) for k in err}
        print(
            json.dumps(
                {"mode": mode, "slots_per_rank": [int(s[0]) for s in slots], "slots_one_device": int(slots[0][1])}
                | worst
            ),
            flush=True,
        )
dist.destroy_process_group()
