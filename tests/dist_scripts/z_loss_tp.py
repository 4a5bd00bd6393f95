"""On 2 gloo ranks: the z-loss (training/zloss.py) against plain PyTorch on the whole logits.
tp 2: logits sharded on the vocabulary (a DTensor, Shard(2), as the output head leaves them for
`loss_parallel`), the z-loss added to the vocab-parallel cross-entropy as the trainer adds it:
the z-loss value, the total and the logits' gradient. A padded vocabulary's -inf columns (the
last 6 of 40, on rank 1) add nothing. cp 2: each rank's half of the sequence (the trainer's
chunks, zigzag or not: the z-loss is a sum over tokens), the ranks' z-losses summed as the
step's all-reduce sums them, and each half's gradient. Prints one JSON line from rank 0."""

import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

from dtensor3d.training.zloss import with_z_loss

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
batch, seq, vocab, coef, ignore = 2, 12, 40, 1e-2, -100
g = torch.Generator().manual_seed(0)  # the same numbers on both ranks
logits = torch.randn(batch, seq, vocab, generator=g) * 4 + 3
logits[..., -6:] = float("-inf")  # padded vocabulary
targets = torch.randint(0, vocab - 6, (batch, seq), generator=g)
targets[0, :5] = ignore  # masked targets count in neither loss
global_tokens = 3 * batch * seq  # this microbatch is a third of the global batch

ref = logits.clone().requires_grad_()
counted = targets != ignore
plain_z = coef * (torch.logsumexp(ref, -1)[counted] ** 2).sum() / global_tokens
plain = F.cross_entropy(ref.flatten(0, 1), targets.flatten(), reduction="sum") / global_tokens + plain_z
plain.backward()

parts: list = []
ce = lambda x, t: F.cross_entropy(x.flatten(0, 1), t.flatten(), reduction="sum") / global_tokens  # noqa: E731
loss_fn = with_z_loss(ce, coef, global_tokens, ignore, parts)
sharded = distribute_tensor(logits.clone(), mesh, [Shard(2)]).requires_grad_()
with loss_parallel():
    total = loss_fn(sharded, targets)
    total.backward()
grad = sharded.grad.full_tensor()

rank, half = dist.get_rank(), seq // 2  # cp 2: this rank's tokens of every row
rows = slice(rank * half, (rank + 1) * half)
chunk, cp_parts = logits[:, rows].clone().requires_grad_(), []
with_z_loss(ce, coef, global_tokens, ignore, cp_parts)(chunk, targets[:, rows]).backward()
cp_z = cp_parts[0].clone()
dist.all_reduce(cp_z)
cp_grad = (chunk.grad - ref.grad[:, rows]).abs().max().reshape(1)
dist.all_reduce(cp_grad, op=dist.ReduceOp.MAX)
out = {
    "z": parts[0].item(),
    "plain_z": plain_z.item(),
    "z_rel": abs(parts[0].item() - plain_z.item()) / plain_z.item(),
    "total_rel": abs(total.full_tensor().item() - plain.item()) / plain.item(),
    "grad_max_abs": (grad - ref.grad).abs().max().item(),
    "grad_scale": ref.grad.abs().max().item(),
    "cp_z_rel": abs(cp_z.item() - plain_z.item()) / plain_z.item(),
    "cp_grad_max_abs": cp_grad.item(),
}
if dist.get_rank() == 0:
    print(json.dumps(out), flush=True)
dist.destroy_process_group()
