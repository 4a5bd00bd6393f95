"""`tp_linear_async_communication: true`: tp communication overlapped with the matmuls, as
nanotron's column/row linears do it. Build time: `apply_async_tp(block, tp_mesh, sp)` takes
the place of the block's projection styles in parallel/tensor.py's plan.

The weights stay DTensors sharded as the synchronous plan shards them (q/k/v and gate/up on
their output dim, o/down on their input dim): FSDP, checkpoints and the optimizer see no
difference. Only the matmul around the collective is one custom autograd Function on the
local pieces, whose collectives are torch's functional ones (async: issued, then waited
for when the result is needed):

- a column group (q/k/v, or gate/up) under sequence parallelism: the input's sequence shard
  is all-gathered in CHUNKS chunks, issued at once; the rank's own rows are multiplied while
  they travel, then each chunk's rows as it arrives (one gather for the whole group). Backward:
  the input gradient is computed chunk by chunk and each chunk's reduce-scatter issued at
  once, the weight gradients computed while they travel.
- a column group under ALL_REDUCE: backward issues the input gradient's all-reduce (one
  for the group) and computes the weight gradients while it travels. A backward to the
  weights alone (the V schedules' split weight pass) computes no input gradient and sends
  nothing.
- a row linear (o, down) under sequence parallelism: the partial output is computed chunk by
  chunk, each chunk's reduce-scatter issued at once (the next chunk's matmul runs while it
  travels); backward all-gathers the output gradient in chunks, the rank's own rows first.
  Under ALL_REDUCE (and for a row linear with a bias) it keeps torch's RowwiseParallel.

The parent module (self_attn, mlp) runs the group's Function in a forward pre-hook and its
projections hand back their slot of the result: the model stays single-device code.
"""

from __future__ import annotations

import types

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

CHUNKS = 2  # pieces each sequence-parallel collective is split into (1 when the shard does not divide)
COLUMN_GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
ROWS = (("self_attn", "o_proj"), ("mlp", "down_proj"))


def _chunks(rows: int, cuda: bool) -> int:
    """Pieces per collective: CHUNKS on CUDA; one on gloo (CPU), where two collectives in
    flight at once on the tp group corrupted the heap (tp 2 sequence parallel, 6 steps: 2
    crashes and 1 hang in 6 runs with two; none in 6 with one)."""
    return CHUNKS if cuda and rows % CHUNKS == 0 else 1


def _gather(x: torch.Tensor, group: str, chunks: int) -> list[torch.Tensor]:
    """Issue the all-gather of x's sequence shard [b, sl, h] in `chunks` pieces; each comes
    back as [tp, b, sl / chunks, h] once waited for."""
    return [funcol.all_gather_single(c.contiguous(), 0, group) for c in x.chunk(chunks, dim=1)]


def _arrived(piece: torch.Tensor, tp: int) -> torch.Tensor:
    got = funcol.wait_tensor(piece)
    return got.view(tp, -1, *got.shape[1:])


def _reduce_scatter(part: torch.Tensor, group: str) -> torch.Tensor:
    """Issue the reduce-scatter of part [b, tp, sc, h] over tp: rank r gets sum [b, sc, h] of [:, r]."""
    return funcol.reduce_scatter_single(part.transpose(0, 1).contiguous(), "sum", 0, group)


def _scattered(pieces: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([funcol.wait_tensor(p)[0] for p in pieces], dim=1)


class _ColumnGroup(torch.autograd.Function):
    """(x, group, tp, rank, sp, w0, b0, w1, b1, ...) -> (x w0^T + b0, x w1^T + b1, ...) with x
    the whole sequence: gathered from its shards under sequence parallelism (sp)."""

    @staticmethod
    def forward(ctx, x, group: str, tp: int, rank: int, sp: bool, *params):
        weights, biases = params[0::2], params[1::2]
        if sp:
            full, ys = _gather_linears(x, weights, biases, group, tp, rank)
        else:
            full, ys = x, [F.linear(x, w, b) for w, b in zip(weights, biases)]
        ctx.save_for_backward(full, *weights)
        ctx.comm, ctx.has_bias = (group, tp, sp), [b is not None for b in biases]
        return tuple(ys)

    @staticmethod
    def backward(ctx, *grads):
        full, *weights = ctx.saved_tensors
        group, tp, sp = ctx.comm
        if not _input_grad_wanted(ctx):  # a split weight backward: no input gradient, no collective
            return (None, None, None, None, None, *_weight_grads(full, grads, ctx.has_bias))
        if sp:  # the input gradient chunk by chunk, each chunk's reduce-scatter issued at once
            b, s = full.shape[:2]
            views = [g.reshape(b, tp, s // tp, -1) for g in grads]
            pieces = [
                _reduce_scatter(sum(v[:, :, c] @ w for v, w in zip(views, weights)), group)
                for c in _slices(s // tp, full.is_cuda)
            ]
        else:  # one all-reduce of the summed input gradient
            pieces = funcol.all_reduce(sum(g @ w for g, w in zip(grads, weights)), "sum", group)
        params = _weight_grads(full, grads, ctx.has_bias)  # while it travels
        grad_x = _scattered(pieces) if sp else funcol.wait_tensor(pieces)
        return (grad_x, None, None, None, None, *params)


def _weight_grads(full: torch.Tensor, grads, has_bias: list[bool]) -> list:
    flat, params = full.reshape(-1, full.shape[-1]), []
    for g, bias in zip(grads, has_bias):
        g2 = g.reshape(-1, g.shape[-1])
        params += [g2.t() @ flat, g2.sum(0) if bias else None]
    return params


def _input_grad_wanted(ctx) -> bool:
    """Whether this backward's graph task reads the input's gradient. The V schedules' weight
    backward (torch.distributed.pipelining: autograd.grad to the weights alone) does not:
    without this check it all-reduced (reduce-scattered) the input gradient a second time
    and threw it away. Always under torch.compile, which traces backward ahead of time (and
    refuses the V schedules)."""
    if torch.compiler.is_compiling():
        return True
    node = ctx.next_functions[0][0]
    return node is not None and torch._C._will_engine_execute_node(node)


def _slices(rows: int, cuda: bool) -> list[slice]:
    step = rows // _chunks(rows, cuda)
    return [slice(i, i + step) for i in range(0, rows, step)]


def _gather_linears(x, weights, biases, group: str, tp: int, rank: int):
    """The whole sequence of x [b, sl, h] and each linear of it, the gather overlapped."""
    b, sl, h = x.shape
    pieces = _gather(x, group, _chunks(sl, x.is_cuda))
    full = x.new_empty(b, tp, sl, h)
    ys = [x.new_empty(b, tp, sl, w.shape[0]) for w in weights]
    full[:, rank] = x
    for y, w, bias in zip(ys, weights, biases):  # this rank's rows while the others travel
        y[:, rank] = F.linear(x, w, bias)
    for cut, piece in zip(_slices(sl, x.is_cuda), pieces):
        got = _arrived(piece, tp)
        for r in range(tp):
            if r != rank:
                full[:, r, cut] = got[r]
                for y, w, bias in zip(ys, weights, biases):
                    y[:, r, cut] = F.linear(got[r], w, bias)
    return full.view(b, tp * sl, h), [y.view(b, tp * sl, -1) for y in ys]


class _RowScatter(torch.autograd.Function):
    """(x [b, s, k_local], w [out, k_local]) -> this rank's sequence shard of sum_tp x w^T."""

    @staticmethod
    def forward(ctx, x, w, group: str, tp: int, rank: int):
        b, s, k = x.shape
        xv = x.reshape(b, tp, s // tp, k)
        pieces = [_reduce_scatter(F.linear(xv[:, :, c], w), group) for c in _slices(s // tp, x.is_cuda)]
        ctx.save_for_backward(xv, w)
        ctx.comm = (group, tp, rank)
        return _scattered(pieces)

    @staticmethod
    def backward(ctx, gy):
        xv, w = ctx.saved_tensors
        group, tp, rank = ctx.comm
        b, _, sl, k = xv.shape
        pieces = _gather(gy, group, _chunks(sl, gy.is_cuda))
        gx = xv.new_empty(b, tp, sl, k)
        gx[:, rank] = gy @ w  # this rank's rows while the others travel
        gw = gy.reshape(-1, gy.shape[-1]).t() @ xv[:, rank].reshape(-1, k)
        for cut, piece in zip(_slices(sl, gy.is_cuda), pieces):
            got = _arrived(piece, tp)
            for r in range(tp):
                if r != rank:
                    gx[:, r, cut] = got[r] @ w
                    gw += got[r].reshape(-1, got.shape[-1]).t() @ xv[:, r, cut].reshape(-1, k)
        return gx.view(b, tp * sl, k), gw, None, None, None


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _shard(dim: int):
    """distribute_module's partition_fn: each parameter of the module sharded on `dim` (a
    bias on its only dim)."""

    def partition(name, module, mesh):
        for key, param in list(module.named_parameters(recurse=False)):
            placement = Shard(min(dim, param.dim() - 1))
            module.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [placement])))

    return partition


def _column_group(parent: nn.Module, names: tuple[str, ...], tp_mesh, sp: bool) -> None:
    linears = [getattr(parent, n) for n in names]
    for linear in linears:
        distribute_module(linear, tp_mesh, _shard(0))
    comm = (tp_mesh.get_group().group_name, tp_mesh.size(), tp_mesh.get_local_rank(), sp)
    stash: dict[str, torch.Tensor] = {}

    def run_group(module, args):
        params = [_local(p) if p is not None else None for m in linears for p in (m.weight, m.bias)]
        stash.update(zip(names, _ColumnGroup.apply(_local(args[0]), *comm, *params)))

    parent.register_forward_pre_hook(run_group)
    for name, linear in zip(names, linears):
        linear.async_tp_slot = (stash, name)
        linear.forward = types.MethodType(_stashed, linear)


def _stashed(linear: nn.Linear, x) -> torch.Tensor:
    """A column projection's forward: its slot of the group's result (x was its input there).
    A method of the linear, not a functools.partial: dynamo guards a partial by its identity,
    so every block (one `_forward` code object) recompiled, into the recompile limit once a
    compiled run had MTP and validation too."""
    stash, name = linear.async_tp_slot
    return stash.pop(name)


def _row(parent: nn.Module, name: str, tp_mesh) -> None:
    linear = getattr(parent, name)
    if linear.bias is not None:  # its bias is added once after the reduction: torch's style
        parallelize_module(parent, tp_mesh, {name: RowwiseParallel(output_layouts=Shard(1))})
        return
    distribute_module(linear, tp_mesh, _shard(1))
    linear.async_tp_comm = (tp_mesh.get_group().group_name, tp_mesh.size(), tp_mesh.get_local_rank())
    linear.forward = types.MethodType(_row_forward, linear)


def _row_forward(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _RowScatter.apply(_local(x), _local(linear.weight), *linear.async_tp_comm)


def apply_async_tp(block: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    """Shard the block's projections over tp with the overlapped Functions above (what
    parallel/tensor.py's plan leaves out when the key is on)."""
    for parent_name, names in COLUMN_GROUPS:
        parent = getattr(block, parent_name, None)
        if parent is not None:
            _column_group(parent, names, tp_mesh, sequence_parallel)
    for parent_name, name in ROWS if sequence_parallel else ():
        parent = getattr(block, parent_name, None)
        if parent is not None:
            _row(parent, name, tp_mesh)
