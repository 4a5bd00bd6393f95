"""Full tensors and this rank's shards: the one path by which init, checkpoint loading and
Hugging Face import put whole tensors into a parallelised model.

A parameter is either a plain tensor (every rank holds it whole) or a DTensor (tp, ep,
fsdp: this rank holds a slice). `copy_full_` takes the whole tensor, as a one-process run
would have it, and keeps this rank's slice; that is what makes init and checkpoints
topology-independent. `init_weights` is the init rule itself (per-parameter seeds).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch
from torch import nn

from ..models import stored_name
from ..models.layers import init_std


def is_dtensor(t) -> bool:
    """isinstance(t, DTensor) without importing DTensor's module (and dynamo with it): a
    process that never made one (generate's) never loads it (a one-token process starts
    sooner)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a DTensor, or the tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def full_shape_mismatch(dst: torch.Tensor, full: torch.Tensor) -> bool:
    return list(full.shape) != list(dst.shape)


@torch.no_grad()
def copy_full_(dst: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's slice of `full` (the whole tensor, any device/dtype) into `dst`, a
    DTensor or a plain tensor of the same global shape. No communication: every rank holds
    `full` and cuts its own piece (`src_data_rank=None`)."""
    if full_shape_mismatch(dst, full):
        raise ValueError(f"full tensor of shape {list(full.shape)} for a tensor of shape {list(dst.shape)}")
    full = full.to(device=local(dst).device, dtype=dst.dtype)
    if is_dtensor(dst):
        from torch.distributed.tensor import distribute_tensor

        full = distribute_tensor(full, dst.device_mesh, dst.placements, src_data_rank=None).to_local()
    local(dst).copy_(full)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU (a collective over its mesh when it is a DTensor)."""
    return (t.full_tensor() if is_dtensor(t) else t).detach().cpu().contiguous()


def param_layout(model: torch.nn.Module) -> dict[str, dict]:
    """How this rank holds each parameter: global and local shape, and for a DTensor the
    mesh axes and placements (e.g. ["dp_cp", "tp"], ["Shard(dim=0)", "Shard(dim=0)"])."""
    out = {}
    for name, p in model.named_parameters():
        entry = {"shape": list(p.shape), "local_shape": list(local(p).shape), "mesh": [], "placements": []}
        if is_dtensor(p):
            entry["mesh"] = list(p.device_mesh.mesh_dim_names or ())
            entry["placements"] = [str(pl) for pl in p.placements]
        out[name] = entry
    return out


def write_layout(
    model: torch.nn.Module,
    coords: dict[str, int],
    rank: int,
    run_dir: str,
    comm: dict | None = None,
    calls: dict | None = None,
) -> str:
    """<run_dir>/layout/rank<R>.json: this rank's coordinates, `param_layout` and (once
    counted) the bytes it handed to collectives in one step, {dim: {kind: bytes}}, and how
    many it issued, {dim: {kind: calls}} (parallel/comm.py). What `logging.layout: true`
    asks for; the tests check it against each parallelism's plan and against `plan`'s
    estimate."""
    path = os.path.join(run_dir, "layout", f"rank{rank}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    record = {"rank": rank, "coords": coords, "params": param_layout(model), "comm_bytes": comm, "comm_calls": calls}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    return path


def param_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Topology-independent init: each full parameter is drawn from its own generator seeded
    by (seed, name), on the CPU, then this rank keeps its slice. Same bits at any mesh (a
    tied head's copy on the last pipeline stage is drawn under the embedding's name)."""
    for name, p in model.named_parameters():
        name = stored_name(model.cfg, name)
        std = init_std(name)
        if std is None:  # a norm's weight: 1, or 0 where the norm scales by 1 + weight (Gemma)
            full = torch.zeros(p.shape) if model.cfg.norm_offset else torch.ones(p.shape)
        else:
            full = _draw(p.shape, param_seed(seed, name), std, model.cfg, name)
        copy_full_(p, full)


VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")


def _draw(shape: torch.Size, seed: int, std: float, cfg, name: str) -> torch.Tensor:
    """A parameter's init; the embedding's and the head's padding rows (model.pad_vocab_to_multiple_of)
    are zeros apart from the real rows, which get exactly the unpadded model's values."""
    gen = torch.Generator().manual_seed(seed)
    if name not in VOCAB_ROWS or shape[0] == cfg.vocab_size:
        return torch.randn(shape, generator=gen) * std
    real = torch.randn((cfg.vocab_size, *shape[1:]), generator=gen) * std
    return torch.cat([real, real.new_zeros((shape[0] - cfg.vocab_size, *shape[1:]))])
