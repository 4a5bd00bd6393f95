"""torch alone (no dtensor3d): torch.compile of a non-reentrant checkpoint whose region runs
scaled_dot_product_attention on the heads of a tp-sharded (ColwiseParallel) projection.

    torchrun --standalone --nproc_per_node=1 bench/compile_checkpoint_tp.py [traced|eager]

`traced` (the default): the block is compiled with the checkpoint inside. torch 2.13 (CPU,
gloo; aot_eager as well as inductor) stops in the first forward with "AssertionError:
expected all tensors_saved_with_vc_check to be Tensors, got types: [Tensor, Tensor,
DeviceMesh]": the DeviceMesh of the graph is saved as if it were a tensor. One rank is
enough. With a matmul-softmax attention instead of sdpa, or without the checkpoint, it
runs. `eager`: the checkpoint stays eager around the compiled
region (dtensor3d's way under recompute: full, parallel/compile.py): it runs, and prints
the gradient norm, equal to the eager model's.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, width: int = 32, head_dim: int = 8):
        super().__init__()
        self.q = nn.Linear(width, width, bias=False)
        self.head_dim = head_dim

    def body(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)  # [b, heads here, s, d]
        return F.scaled_dot_product_attention(q, q, q)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.body, x, use_reentrant=False)


def main(mode: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    block = Block()
    parallelize_module(block, mesh, {"q": ColwiseParallel()})
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
    eager = x.clone().requires_grad_()
    block(eager).sum().backward()
    block.zero_grad()
    if mode == "eager":
        block.body = torch.compile(block.body, backend="aot_eager")
    else:
        block.compile(backend="aot_eager")
    compiled = x.clone().requires_grad_()
    block(compiled).sum().backward()
    same = torch.allclose(compiled.grad, eager.grad, rtol=1e-5, atol=1e-6)
    print(f"rank {dist.get_rank()}: {mode}: ran; input grad norm {compiled.grad.norm():.6f}, equal to eager: {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "traced")
