"""Muon's whole matrices under any sharding: one owner rank per matrix gathers it, runs
Newton-Schulz on it, and sends each rank its piece back (the scheme of Dion / torchtitan's
DistMuon), so no rank gathers every matrix.

A unit is one matrix: a 2-D parameter, or one expert e of a stacked [E, in, out] expert
weight (orthogonalised alone, in the Linear orientation [out, in] that torch.optim.Muon sees
in a Hugging Face model). Its holders are the ranks whose local piece (checkpoint/slices.py's
`held_indices`: Shard, FSDP's _StridedShard over tp, ep's expert split) meets it, among the
ranks that share this rank's coordinates on the mesh dims that replicate the parameter: each
replica group orthogonalises its own copy, the same bits. Owners go round-robin over the
units that have the same holders. Pieces travel as point-to-point sends in Newton-Schulz's
dtype (optimizer.muon_ns_dtype; bf16, torch's: its Newton-Schulz rounds its input to bf16
first and returns bf16; or fp32, the same iteration unrounded), so nothing needs a process
group of its own, and every rank posts its sends and receives in the same unit order.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS

from ..checkpoint.slices import held_indices
from ..parallel.comm import OPTIMIZER_TAG
from ..parallel.shards import is_dtensor, local

Index = tuple[torch.Tensor, torch.Tensor]  # rows [r, 1] and columns [1, c] of a piece in its full matrix


@dataclass
class Unit:
    """One matrix: parameter `param`, expert `expert` (None: the 2-D parameter itself)."""

    param: torch.Tensor
    expert: int | None
    shape: tuple[int, int]  # the matrix as stored: [out, in], or [in, out] for an expert
    owner: int
    mine: int | None  # this rank's position of the expert in its local piece (None: 2-D)
    pieces: dict[int, Index] = field(default_factory=dict)  # holder rank -> where its piece lies


def _replica_coords(p: torch.Tensor) -> list[tuple[int, ...]]:
    """The mesh coordinates of the ranks that hold other pieces of p than this rank (or the
    same): every coordinate that agrees with this rank's on the mesh dims that replicate p."""
    mesh, me = p.device_mesh, p.device_mesh.get_coordinate()
    axes = [range(n) if not pl.is_replicate() else [me[d]] for d, (n, pl) in enumerate(zip(mesh.shape, p.placements))]
    return list(itertools.product(*axes))


def _pieces(p: torch.Tensor) -> list[tuple[int, list]]:
    """(global rank, held indices) of each rank of p's replica group, in mesh order."""
    if not is_dtensor(p):
        return [(dist.get_rank() if dist.is_initialized() else 0, held_indices(p))]
    ranks = p.device_mesh.mesh
    return [(int(ranks[c]), held_indices(p, c)) for c in _replica_coords(p)]


def _index(rows, cols) -> Index:
    return torch.tensor(list(rows)).view(-1, 1), torch.tensor(list(cols)).view(1, -1)


def plan_units(params: list[torch.Tensor]) -> list[Unit]:
    """Every matrix of `params` this rank holds a piece of, with its owner and holders' pieces."""
    me = dist.get_rank() if dist.is_initialized() else 0
    turns: dict[tuple[int, ...], int] = {}  # holders -> units assigned so far (the round-robin)
    units = []
    for p in params:
        pieces = _pieces(p)
        experts = range(p.shape[0]) if p.ndim == 3 else [None]
        for e in experts:
            held = {}
            for rank, idx in pieces:
                rows, cols = idx[-2], idx[-1]
                if len(rows) and len(cols) and (e is None or e in idx[0]):
                    held[rank] = (idx, _index(rows, cols))
            holders = tuple(held)
            if me not in held:
                continue
            turn = turns.get(holders, 0)
            turns[holders] = turn + 1
            mine = None if e is None else list(held[me][0][0]).index(e)
            shape = tuple(p.shape[-2:])
            unit = Unit(p, e, shape, holders[turn % len(holders)], mine)
            unit.pieces = {rank: ix for rank, (_, ix) in held.items()}
            units.append(unit)
    return units


def _piece(u: Unit, tensors: dict) -> torch.Tensor:
    t = tensors[u.param]
    return t if u.mine is None else t[u.mine]


def zeropower(grad: torch.Tensor, dtype: torch.dtype, steps: int) -> torch.Tensor:
    """torch 2.13's `_zeropower_via_newtonschulz` with torch's coefficients and eps, its input
    cast to `dtype` and every step run in it: bfloat16 is torch's own (bitwise), float32 the
    same iteration without bf16's rounding (optimizer.muon_ns_dtype)."""
    a, b, c = DEFAULT_A, DEFAULT_B, DEFAULT_C
    x = grad.to(dtype, copy=True)
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=EPS))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if tall else x


def newton_schulz(full: torch.Tensor, expert: bool, steps: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation of one matrix (an expert's in [out, in] orientation)."""
    m = full.mT if expert else full
    out = zeropower(m, dtype, steps)
    return out.mT if expert else out


def orthogonalise(units: list[Unit], updates: dict, steps: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Each parameter's local piece of its orthogonalised update (in `dtype`, Newton-Schulz's),
    from the local pieces of its Nesterov update: gather to the owner, Newton-Schulz there, scatter back."""
    me = dist.get_rank() if dist.is_initialized() else 0
    sent = {p: u.to(dtype) for p, u in updates.items()}
    out = {p: torch.empty_like(u) for p, u in sent.items()}
    fulls, reqs, arrived = {}, [], []
    for k, u in enumerate(units):  # 1. every piece to its owner
        if u.owner == me:
            full = fulls[k] = torch.empty(u.shape, dtype=dtype, device=sent[u.param].device)
            for rank, ix in u.pieces.items():
                if rank == me:
                    full[ix] = _piece(u, sent)
                else:
                    buf = torch.empty(ix[0].shape[0], ix[1].shape[1], dtype=full.dtype, device=full.device)
                    reqs.append(dist.irecv(buf, rank, tag=OPTIMIZER_TAG))
                    arrived.append((full, ix, buf))
        else:
            piece = _piece(u, sent).contiguous()
            reqs.append(dist.isend(piece, u.owner, tag=OPTIMIZER_TAG))
            arrived.append((None, None, piece))  # keep the sent tensor alive until its send completes
    _wait(reqs)
    for full, ix, buf in arrived:
        if full is not None:
            full[ix] = buf
    return _scatter(units, fulls, out, steps, me, dtype)


def _scatter(units: list[Unit], fulls: dict, out: dict, steps: int, me: int, dtype: torch.dtype) -> dict:
    """2. and 3.: the owner orthogonalises, then every holder receives its piece."""
    reqs, back = [], []
    for k, u in enumerate(units):
        target = _piece(u, out)
        if u.owner == me:
            ortho = newton_schulz(fulls.pop(k), u.expert is not None, steps, dtype)
            for rank, ix in u.pieces.items():
                if rank == me:
                    target.copy_(ortho[ix])
                else:
                    piece = ortho[ix].contiguous()
                    reqs.append(dist.isend(piece, rank, tag=OPTIMIZER_TAG))
                    back.append((None, piece))
        else:
            buf = torch.empty_like(target) if not target.is_contiguous() else target
            reqs.append(dist.irecv(buf, u.owner, tag=OPTIMIZER_TAG))
            back.append((target, buf))
    _wait(reqs)
    for target, buf in back:
        if target is not None and buf is not target:
            target.copy_(buf)
    return out


def _wait(reqs: list) -> None:
    for r in reqs:
        r.wait()


def exchanged_bytes(units: list[Unit], me: int, width: int = 2) -> tuple[int, int]:
    """(bytes this rank sends, the owner's largest transient: the matrices it owns), pieces of
    `width` bytes an element (bf16 2, fp32 4: optimizer.muon_ns_dtype)."""
    sent = owned = 0
    for u in units:
        rows, cols = u.pieces[me][0].shape[0], u.pieces[me][1].shape[1]
        if u.owner == me:
            owned += u.shape[0] * u.shape[1] * width
            sent += sum(ix[0].shape[0] * ix[1].shape[1] * width for r, ix in u.pieces.items() if r != me)
        else:
            sent += rows * cols * width
    return sent, owned


def local_tensors(params: list[torch.Tensor]) -> dict:
    return {p: local(p) for p in params}
