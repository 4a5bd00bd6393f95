"""Muon's whole matrices under any sharding: one owner rank per matrix gathers it, runs
Newton-Schulz on it, and sends each rank its piece back (the scheme of Dion / torchtitan's
DistMuon), so no rank gathers every matrix.

A unit is one matrix: a 2-D parameter, or one expert e of a stacked [E, in, out] expert
weight (orthogonalised alone, in the Linear orientation [out, in] that torch.optim.Muon sees
in a Hugging Face model). Its holders are the ranks whose local piece (checkpoint/slices.py's
`held_indices`: Shard, FSDP's _StridedShard over tp, ep's expert split) meets it, among the
ranks that share this rank's coordinates on the mesh dims that replicate the parameter: each
replica group orthogonalises its own copy, the same bits. Owners go round-robin over the
units that have the same holders. Pieces travel as point-to-point sends (bf16: torch's
Newton-Schulz rounds its input to bf16 first and returns bf16), so nothing needs a process
group of its own, and every rank posts its sends and receives in the same unit order.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _zeropower_via_newtonschulz

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


def newton_schulz(full: torch.Tensor, expert: bool, steps: int) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation of one matrix (an expert's in [out, in] orientation)."""
    m = full.mT if expert else full
    out = _zeropower_via_newtonschulz(m, (DEFAULT_A, DEFAULT_B, DEFAULT_C), steps, EPS)
    return out.mT if expert else out


def orthogonalise(units: list[Unit], updates: dict, steps: int) -> dict:
    """Each parameter's local piece of its orthogonalised update (bf16), from the local pieces
    of its Nesterov update: gather to the owner, Newton-Schulz there, scatter back."""
    me = dist.get_rank() if dist.is_initialized() else 0
    sent = {p: u.bfloat16() for p, u in updates.items()}
    out = {p: torch.empty_like(u) for p, u in sent.items()}
    fulls, reqs, arrived = {}, [], []
    for k, u in enumerate(units):  # 1. every piece to its owner
        if u.owner == me:
            full = fulls[k] = torch.empty(u.shape, dtype=torch.bfloat16, device=sent[u.param].device)
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
    return _scatter(units, fulls, out, steps, me)


def _scatter(units: list[Unit], fulls: dict, out: dict, steps: int, me: int) -> dict:
    """2. and 3.: the owner orthogonalises, then every holder receives its piece."""
    reqs, back = [], []
    for k, u in enumerate(units):
        target = _piece(u, out)
        if u.owner == me:
            ortho = newton_schulz(fulls.pop(k), u.expert is not None, steps)
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


def exchanged_bytes(units: list[Unit], me: int) -> tuple[int, int]:
    """(bytes this rank sends, the owner's largest transient: the bf16 matrices it owns)."""
    sent = owned = 0
    for u in units:
        rows, cols = u.pieces[me][0].shape[0], u.pieces[me][1].shape[1]
        if u.owner == me:
            owned += u.shape[0] * u.shape[1] * 2
            sent += sum(ix[0].shape[0] * ix[1].shape[1] * 2 for r, ix in u.pieces.items() if r != me)
        else:
            sent += rows * cols * 2
    return sent, owned


def local_tensors(params: list[torch.Tensor]) -> dict:
    return {p: local(p) for p in params}
