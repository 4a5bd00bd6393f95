"""Your own model, parallelized on dtensor3d's mesh with your own tp plan table
(docs/guides/library.md, "Your own model").

`dtensor3d.parallelize` builds the recipe's model families only: their tp plan, pipeline
split and hooks are written for them. A model of your own goes through the same PyTorch
tools dtensor3d uses, on the mesh dtensor3d builds: a table of DTensor styles for tp
(`parallelize_module`), then FSDP2 (`fully_shard`) over dp.

    torchrun --standalone --nproc_per_node=4 examples/custom_model.py 2 2 LOG.jsonl   # dp 2 x tp 2
    torchrun --standalone --nproc_per_node=1 examples/custom_model.py 1 1 LOG.jsonl   # one process
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dtensor3d
from dtensor3d.config.schema import ParallelismConfig
from dtensor3d.mesh import init_distributed

VOCAB, WIDTH, HIDDEN, LAYERS, SEQ, BATCH, STEPS = 64, 32, 128, 2, 16, 8, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """A per-token MLP language model: single-device code, nothing distributed in it."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# The tp plan: module name -> DTensor style. up is split by its output features, down by its
# input features; down's output is summed over tp and comes back a plain tensor.
TP_PLAN = {}
for i in range(LAYERS):
    TP_PLAN[f"blocks.{i}.up"] = ColwiseParallel()
    TP_PLAN[f"blocks.{i}.down"] = RowwiseParallel()


def build(dp: int, tp: int):
    """The mesh from dtensor3d (axes ep, pp, dp, cp, tp), the model from a fixed seed on every
    rank, tp from the table, FSDP2 over dp for each block and the root."""
    mesh = dtensor3d.build_mesh(ParallelismConfig(dp=dp, tp=tp), "cpu")
    torch.manual_seed(0)
    model = TinyLM()
    parallelize_module(model, mesh["tp"], TP_PLAN)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return mesh, model


def main(dp: str, tp: str, log_path: str) -> None:
    init_distributed("cpu")
    mesh, model = build(int(dp), int(tp))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp_rank, n_dp = mesh["dp"].get_local_rank(), int(dp)
    data = torch.Generator().manual_seed(1)
    log = open(log_path, "w") if dist.get_rank() == 0 else None
    for step in range(1, STEPS + 1):
        batch = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=data)  # the same global batch everywhere
        rows = batch.chunk(n_dp)[dp_rank]  # this dp rank's rows
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())  # FSDP2 averages grads over dp
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh["dp"].get_group())
        if log:
            log.write(json.dumps({"step": step, "loss": mean.item() / n_dp}) + "\n")
    if log:
        log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
