"""Measure the bytes each rank hands to collectives in one training step, per mesh dim and
per collective kind, and print them as JSON lines (one per rank) for comparison with
`dtensor3d.estimate.comm_bytes`.

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
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from dtensor3d.datasets.sources import make_source
from dtensor3d.mesh import AXES, FLAT_VIEWS, mesh_axis
from dtensor3d.parallel.shards import local
from dtensor3d.recipe import load_recipe
from dtensor3d.train import rank_batch, setup, train_step

KINDS = (
    ("reduce_scatter", "reduce_scatter"),
    ("allgather", "all_gather"),
    ("all_gather", "all_gather"),
    ("allreduce", "all_reduce"),
    ("all_reduce", "all_reduce"),
    ("alltoall", "all_to_all"),
    ("all_to_all", "all_to_all"),
    ("send", "send_recv"),
    ("recv", "send_recv"),
    ("broadcast", "broadcast"),
)
INPUTS = ("input", "input_tensor", "input_tensors", "inputs", "tensors")


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


class CommCounter(TorchDispatchMode):
    """bytes[dim][kind] handed to collectives while active (see the module docstring)."""

    def __init__(self, group_dims: dict[str, str]):
        super().__init__()
        self.group_dims, self.force = group_dims, None
        self.bytes = defaultdict(lambda: defaultdict(int))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into collectives first
        if func.namespace in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
            self._record(func, args, kwargs)
        return func(*args, **kwargs)

    def _record(self, func, args, kwargs):
        name = func._schema.name.split("::")[1]
        kind = next((k for frag, k in KINDS if frag in name), None)
        if kind is None:
            return  # wait_tensor, barrier, ...
        values = dict(zip([a.name for a in func._schema.arguments], args)) | kwargs
        group = values.get("process_group", values.get("group_name"))
        if not isinstance(group, str):
            group = (group if isinstance(group, dist.ProcessGroup) else dist.ProcessGroup.unbox(group)).group_name
        dim = self.force or self.group_dims[group]
        sent = 0 if name.startswith("recv") else sum(t.numel() * t.element_size() for t in _tensors(_input(values)))
        self.bytes[dim][kind] += sent


def _input(values: dict):
    return next(values[n] for n in INPUTS if n in values)


def group_dims(mesh) -> dict[str, str]:
    """group name -> the dim it is counted under; two dims sharing a group is refused."""
    names: dict[str, str] = {}
    for view, dim in [(a, a) for a in AXES] + [(v, "dp") for v in FLAT_VIEWS]:
        if mesh_axis(mesh, view).size() == 1:
            continue
        name = mesh_axis(mesh, view).get_group().group_name
        if names.get(name, dim) != dim:
            raise SystemExit(f"groups {names[name]} and {dim} are one group; choose a mesh that separates them")
        names[name] = dim
    return names


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
    counter = CommCounter(group_dims(state.mesh))
    real_all_reduce = dist.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        counter.force = "world" if group is None else None  # the step's stats all-reduce
        try:
            return real_all_reduce(tensor, op=op, group=group, async_op=async_op)
        finally:
            counter.force = None

    source = make_source(recipe)
    train_step(state, rank_batch(state, source, 0))
    dist.all_reduce = all_reduce
    with counter:
        train_step(state, rank_batch(state, source, 1))
    dist.all_reduce = real_all_reduce
    out = {"rank": dist.get_rank(), "coords": state.coords, "bytes": {d: dict(k) for d, k in counter.bytes.items()}}
    out.update(memory(state))
    print("COMM " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
