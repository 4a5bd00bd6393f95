"""Measure the bytes each rank hands to collectives in one training step, per mesh dim and
per collective kind, and print them as JSON lines (one per rank) for comparison with
`dtensor3d.plan.collectives.comm_bytes`.

Counting: a TorchDispatchMode sees every collective our code issues -- c10d ops (FSDP2,
the cp gather, pipelining's send, the replicate all-reduce, the world stats all-reduce) and
functional collectives (DTensor's redistributes under tp) -- and adds the bytes of the
op's input tensors: an all-gather counts the local piece, a reduce-scatter the whole input,
an all-reduce the tensor, an all-to-all what the rank sends, send/recv the sent tensor
(a recv counts nothing: its bytes are the peer's send). The group names the mesh dim:
tp, pp, cp, ep; dp, dp_cp, ep_dp_cp -> "dp"; a call on the default group -> "world".

usage: torchrun ... comm_bytes.py RECIPE [key=value ...]   (counts step 2: step 1 also
runs the pipeline's shape inference)
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from dtensor3d.config.load import load_recipe
from dtensor3d.datasets.sources import make_source
from dtensor3d.parallel.comm import count_step
from dtensor3d.parallel.shards import local
from dtensor3d.training.train import rank_batch, setup, train_step


def memory(state) -> dict:
    """This rank's parameter count and parameter, gradient and AdamW state bytes."""
    params = [local(q) for q in state.model.parameters()]
    grads = [local(q.grad) for q in state.model.parameters() if q.grad is not None]
    states = [local(v) for st in state.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    return {
        "params": sum(t.numel() for t in params),
        "param_bytes": nbytes(params),
        "grad_bytes": nbytes(grads),
        "optimizer_bytes": nbytes(states),
    }


def main() -> None:
    recipe_path, *overrides = sys.argv[1:]
    recipe = load_recipe(recipe_path, overrides, world_size=int(os.environ["WORLD_SIZE"]))
    state = setup(recipe)
    source = make_source(recipe)
    train_step(state, rank_batch(state, source, 0))
    with count_step(state.mesh) as counter:  # the library's counter (dtensor3d/parallel/comm.py)
        train_step(state, rank_batch(state, source, 1))
    out = {"rank": dist.get_rank(), "coords": state.coords, "bytes": counter.result()}
    out.update(memory(state))
    print("COMM " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
