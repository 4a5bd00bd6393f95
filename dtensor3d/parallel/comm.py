"""Bytes each rank hands to collectives, per mesh dim and collective kind, counted on a real
step (what `logging.layout: true` records for one step, and what `plan`'s estimate predicts).

A TorchDispatchMode sees every collective the step issues: c10d ops (FSDP2, the cp gather,
pipelining's sends, the replicate all-reduce, the step's stats all-reduce) and functional
collectives (DTensor's redistributes under tp). It adds the bytes of the op's input: an
all-gather counts the local piece, a reduce-scatter the whole input, an all-reduce the
tensor, an all-to-all what the rank sends, send/recv the sent tensor (a recv counts nothing:
its bytes are the peer's send). The group names the mesh dim: tp, pp, cp, ep; dp, dp_cp,
ep_dp_cp (and HSDP's views) -> "dp"; a tied embedding's group (pp > 2) -> "pp"; the step's
stats all-reduce on the default group -> "world". Dims that share one process group (e.g. cp
and dp_cp at dp 1) are counted under their names joined by "+".
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..mesh import AXES, mesh_axis, mesh_views
from .tied import GROUP_DESC as TIED_GROUP

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
# The tag of the optimizer's point-to-point sends (Muon's owner-rank exchange,
# training/muon_owners.py): counted under "world" whatever mesh dim shares the default group.
OPTIMIZER_TAG = 37
INPUTS = ("input", "input_tensor", "input_tensors", "inputs", "tensors")
MATMULS = ("mm", "addmm", "bmm", "baddbmm")


def tensors_in(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from tensors_in(y)


def group_dims(mesh) -> dict[str, str]:
    """process group name -> the dim its bytes count under (dims sharing a group: "a+b")."""
    names: dict[str, list[str]] = {}
    hsdp = [(a, "dp") for a in ("dp_replicate", "dp_shard") if a in (mesh.mesh_dim_names or ())]
    for view, dim in [(a, a) for a in AXES] + hsdp + [(v, "dp") for v in mesh_views(mesh) if v != "dp"]:
        if mesh_axis(mesh, view).size() == 1:
            continue
        dims = names.setdefault(mesh_axis(mesh, view).get_group().group_name, [])
        if dim not in dims:
            dims.append(dim)
    for pg, name in list(dist.distributed_c10d._world.pg_names.items()):
        if getattr(pg, "group_desc", "").startswith(TIED_GROUP):  # a tied embedding's group at pp > 2
            names.setdefault(name, ["pp"])
    return {group: "+".join(sorted(dims)) for group, dims in names.items()}


class CommCounter(TorchDispatchMode):
    """bytes[dim][kind] handed to collectives while active (see the module docstring), and
    calls[dim][kind], how many.

    For functional collectives (tp's) it also keeps, per dim and kind, how many were issued
    (`issued`), how many of those saw a matmul run between their issue and their wait
    (`overlapped`: asynchronous in fact), and the seconds this thread spent waiting for them
    (`wait_s`, per dim)."""

    def __init__(self, mesh):
        super().__init__()
        self.group_dims, self.force = group_dims(mesh), None
        self.bytes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.calls: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.issued: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.overlapped: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.wait_s: dict[str, float] = defaultdict(float)
        self.pending: dict[int, list] = {}  # id(output) -> [dim, kind, overlapped]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into collectives first
        if any(issubclass(t, AsyncCollectiveTensor) for t in types):
            # The tensor waits for itself (its wait_tensor comes back here). Unwrapping it here
            # instead corrupted the heap in about a third of tp_linear_async_communication runs
            # (malloc's "unaligned tcache chunk", SIGSEGV; 0 of 6 since).
            return NotImplemented
        name = func._schema.name.split("::")[1]
        if func.namespace == "_c10d_functional" and name == "wait_tensor":
            return self._wait(args[0], lambda: func(*args, **kwargs))
        if func.namespace == "aten" and name in MATMULS:
            for entry in self.pending.values():
                entry[2] = True
        if func.namespace in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
            out = func(*args, **kwargs)
            self._record(func, args, kwargs, out)
            return out
        return func(*args, **kwargs)

    def _wait(self, tensor, wait):
        start = time.perf_counter()
        out = wait()
        entry = self.pending.pop(id(tensor), None)
        if entry is not None:
            dim, kind, overlapped = entry
            self.wait_s[dim] += time.perf_counter() - start
            self.issued[dim][kind] += 1
            self.overlapped[dim][kind] += overlapped
        return out

    def _record(self, func, args, kwargs, out) -> None:
        name = func._schema.name.split("::")[1]
        kind = next((k for frag, k in KINDS if frag in name), None)
        if kind is None:
            return  # wait_tensor, barrier, ...
        values = dict(zip([a.name for a in func._schema.arguments], args)) | kwargs
        group = values.get("process_group", values.get("group_name"))
        if not isinstance(group, str):
            group = (group if isinstance(group, dist.ProcessGroup) else dist.ProcessGroup.unbox(group)).group_name
        dim = self.force or self.group_dims.get(group, "world")
        if values.get("tag") == OPTIMIZER_TAG:  # the optimizer's own sends, on the default group
            dim = "world"
        payload = next(values[n] for n in INPUTS if n in values)
        sent = 0 if name.startswith("recv") else sum(t.numel() * t.element_size() for t in tensors_in(payload))
        self.bytes[dim][kind] += sent
        self.calls[dim][kind] += 1
        if func.namespace == "_c10d_functional" and isinstance(out, torch.Tensor):
            self.pending[id(out)] = [dim, kind, False]

    def result(self) -> dict[str, dict[str, int]]:
        return {d: dict(kinds) for d, kinds in self.bytes.items()}


@contextlib.contextmanager
def count_step(mesh):
    """Count the collectives of the enclosed step; an all-reduce on the default group (the
    step's stats) counts under "world" even where a mesh dim's group spans the world."""
    counter, real = CommCounter(mesh), dist.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        counter.force = "world" if group is None else None
        try:
            return real(tensor, op=op, group=group, async_op=async_op)
        finally:
            counter.force = None

    dist.all_reduce = all_reduce
    try:
        # The counted step runs eager (what plan's byte counts model). Met under the mode instead,
        # dynamo skips each compiled frame and marks its code to be skipped for good: the run went
        # eager after the counted step, compiling each of torchao's float8 __torch_dispatch__
        # calls as a frame of its own into the recompile limit (glm4_moe cp 2 and qwen3 dp 2 x
        # tp 2 x pp 2 compiled float8 runs of the matrix stopped at step 3).
        with torch.compiler.set_stance("force_eager"), counter:
            yield counter
    finally:
        dist.all_reduce = real
