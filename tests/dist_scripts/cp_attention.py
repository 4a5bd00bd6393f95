"""On 4 gloo ranks: context-parallel attention (cp 2 and cp 4, with and without grouped-query
attention, and with values narrower than q/k as multi-head latent attention has them (kv_heads
4, v_dim 6), both kernels: "flash" and "masked") against single-device causal attention,
outputs and input gradients; then sliding windows (with and without packed documents) against
single-device windowed attention. Prints one JSON line per case from rank 0 with the largest
absolute errors over all ranks."""

import itertools
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dtensor3d.config.parallelism import window_tails
from dtensor3d.models.layers import causal_attention, document_attention
from dtensor3d.parallel.context import KERNELS, cp_attention, shard_sequence, zigzag_positions

dist.init_process_group("gloo")
world = dist.get_world_size()
for cp in (2, 4):
    mesh = init_device_mesh("cpu", (world // cp, cp), mesh_dim_names=("rest", "cp"))["cp"]
    rank = mesh.get_local_rank()
    for kv_heads, v_dim in ((4, 8), (2, 8), (4, 6)):
        g = torch.Generator().manual_seed(100 * cp + kv_heads + v_dim)
        b, h, s, d = 2, 4, 32, 8
        q = torch.randn(b, h, s, d, generator=g, requires_grad=True)
        k = torch.randn(b, kv_heads, s, d, generator=g, requires_grad=True)
        v = torch.randn(b, kv_heads, s, v_dim, generator=g, requires_grad=True)
        w = torch.randn(b, h, s, v_dim, generator=g)
        ref = causal_attention(q, k, v)
        (ref * w).sum().backward()

        for kernel in KERNELS:
            ql, kl, vl = (shard_sequence(t.detach(), cp, rank, dim=2).requires_grad_() for t in (q, k, v))
            k_pos = torch.cat([zigzag_positions(s, cp, r) for r in range(cp)])
            out = cp_attention(
                ql, kl, vl, group=mesh.get_group(), q_pos=zigzag_positions(s, cp, rank), k_pos=k_pos, kernel=kernel
            )
            (out * shard_sequence(w, cp, rank, dim=2)).sum().backward()

            errs = torch.tensor(
                [
                    (out - shard_sequence(ref, cp, rank, dim=2)).abs().max(),
                    (ql.grad - shard_sequence(q.grad, cp, rank, dim=2)).abs().max(),
                    (kl.grad - shard_sequence(k.grad, cp, rank, dim=2)).abs().max(),
                    (vl.grad - shard_sequence(v.grad, cp, rank, dim=2)).abs().max(),
                ]
            )
            dist.all_reduce(errs, op=dist.ReduceOp.MAX)
            if dist.get_rank() == 0:
                print(
                    json.dumps(
                        {
                            "cp": cp,
                            "kv_heads": kv_heads,
                            "v_dim": v_dim,
                            "kernel": kernel,
                            "out": errs[0].item(),
                            "dq": errs[1].item(),
                            "dk": errs[2].item(),
                            "dv": errs[3].item(),
                            "ref_scale": ref.abs().max().item(),
                        }
                    ),
                    flush=True,
                )

# Sliding windows: a window that fits in a zigzag chunk (3 and 5 at cp 4's chunks of 4; 3, 5 and
# 9 at cp 2's of 8) takes window_attention (only the chunks' tails gathered); 9 at cp 4 gathers
# the whole sequence. With and without packed documents, grouped-query attention (kv_heads 2).
for cp in (2, 4):
    mesh = init_device_mesh("cpu", (world // cp, cp), mesh_dim_names=("rest", "cp"))["cp"]
    rank = mesh.get_local_rank()
    for window, packed in itertools.product((3, 5, 9), (False, True)):
        g = torch.Generator().manual_seed(7 * cp + window + packed)
        b, h, kv_heads, s, d = 2, 4, 2, 32, 8
        q = torch.randn(b, h, s, d, generator=g, requires_grad=True)
        k = torch.randn(b, kv_heads, s, d, generator=g, requires_grad=True)
        v = torch.randn(b, kv_heads, s, d, generator=g, requires_grad=True)
        w = torch.randn(b, h, s, d, generator=g)
        docs = torch.randint(0, 3, (b, s), generator=g).sort(dim=1).values if packed else None
        ref = causal_attention(q, k, v, window) if docs is None else document_attention(q, k, v, docs, window)
        (ref * w).sum().backward()
        ql, kl, vl = (shard_sequence(t.detach(), cp, rank, dim=2).requires_grad_() for t in (q, k, v))
        k_pos = torch.cat([zigzag_positions(s, cp, r) for r in range(cp)])
        local_docs = None if docs is None else shard_sequence(docs, cp, rank, dim=1)
        out = cp_attention(
            ql,
            kl,
            vl,
            group=mesh.get_group(),
            q_pos=zigzag_positions(s, cp, rank),
            k_pos=k_pos,
            document_ids=local_docs,
            window=window,
        )
        (out * shard_sequence(w, cp, rank, dim=2)).sum().backward()
        errs = torch.tensor(
            [
                (out - shard_sequence(ref, cp, rank, dim=2)).abs().max(),
                (ql.grad - shard_sequence(q.grad, cp, rank, dim=2)).abs().max(),
                (kl.grad - shard_sequence(k.grad, cp, rank, dim=2)).abs().max(),
                (vl.grad - shard_sequence(v.grad, cp, rank, dim=2)).abs().max(),
            ]
        )
        dist.all_reduce(errs, op=dist.ReduceOp.MAX)
        if dist.get_rank() == 0:
            tails = window_tails(window, s, cp)
            row = {"cp": cp, "window": window, "packed": packed, "tails": tails}
            print(json.dumps(row | dict(zip(("out", "dq", "dk", "dv"), errs.tolist()))), flush=True)
# Under bf16 autocast (training.dtype bfloat16 without FSDP): RoPE leaves q and k in fp32 and v is a
# linear's bf16 output; SDPA casts all three to bf16 there, and cp_attention must too (the flash op
# itself is on no autocast list). Its error from the fp32 attention against single-device autocast's.
mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("rest", "cp"))["cp"]
rank = mesh.get_local_rank()
for kernel, window in itertools.product(KERNELS, (None, 5)):
    g = torch.Generator().manual_seed(11 + (window or 0))
    b, h, kv_heads, s, d = 2, 4, 2, 32, 8
    q, k, v = (torch.randn(b, n, s, d, generator=g) for n in (h, kv_heads, kv_heads))
    truth = causal_attention(q, k, v, window)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        single = causal_attention(q, k, v.bfloat16(), window)
        local = [shard_sequence(t, 2, rank, dim=2) for t in (q, k, v.bfloat16())]
        k_pos = torch.cat([zigzag_positions(s, 2, r) for r in range(2)])
        out = cp_attention(
            *local,
            group=mesh.get_group(),
            q_pos=zigzag_positions(s, 2, rank),
            k_pos=k_pos,
            kernel=kernel,
            window=window,
        )
    mine = shard_sequence(truth, 2, rank, dim=2)
    errs = torch.tensor(
        [(out.float() - mine).abs().max(), (shard_sequence(single, 2, rank, dim=2).float() - mine).abs().max()]
    )
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        row = {"autocast": kernel, "window": window, "dtype": str(out.dtype), "single_dtype": str(single.dtype)}
        print(json.dumps(row | {"err": errs[0].item(), "single_err": errs[1].item()}), flush=True)
dist.destroy_process_group()
