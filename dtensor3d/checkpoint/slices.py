"""Checkpoints by slices: where this rank's piece of each tensor lies in the full tensor,
which rank writes each distinct piece, and reading any region of a full tensor from the
pieces on disk. Nothing here communicates: a save writes local pieces, a load reads the
regions its local pieces cover, so no rank holds more than its own shards plus one region.

A DTensor's local piece is, along each tensor dim, a sequence of global indices (Shard: a
chunk, as torch.chunk cuts; FSDP2-over-TP's _StridedShard: the same chunk of each of the
split_factor chunks the later placements cut first). The piece is the product of those
sequences, cut into boxes of contiguous runs: one box for every layout dtensor3d builds,
several for a layout that is not a box.

The index (state.json's "tensors", format version 2): name -> {"shape": full shape,
"slices": [{"file", "key", "offset", "shape"}]}; the slices of a tensor tile it exactly.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence

import torch
from safetensors import safe_open

from ..errors import CheckpointError
from ..mesh import rank_coords
from ..parallel.shards import is_dtensor, local
from .format import read_header

Box = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # (local start, global start, size)
REPLICA_AXES = ("ep", "dp", "cp", "tp")  # a stage's ranks differ only on these
TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _chunk(seq: Sequence[int], n: int, i: int) -> Sequence[int]:
    """Piece i of seq cut into n as torch.chunk cuts (ceil-sized pieces, the last ones short or empty)."""
    size = -(-len(seq) // n)
    return seq[i * size : (i + 1) * size]


def _splits(pl) -> bool:
    """Whether a placement splits its tensor (Shard, or _StridedShard, whose is_shard() is False)."""
    return _strided(pl) or pl.is_shard()


def _strided(pl) -> bool:
    """A placement exists only where DTensor's module is loaded: import it only then."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(pl, _StridedShard)


def held_indices(t: torch.Tensor, coord: Sequence[int] | None = None) -> list[Sequence[int]]:
    """For each dim of `t`'s full shape, the global indices the local piece at mesh coordinate
    `coord` (None: this rank's) holds, in local order."""
    idx: list[Sequence[int]] = [range(n) for n in t.shape]
    if not is_dtensor(t):
        return idx
    mesh = t.device_mesh
    coord = mesh.get_coordinate() if coord is None else coord
    for mdim, pl in enumerate(t.placements):
        m, c = mesh.size(mdim), coord[mdim]
        if _strided(pl):
            sf, d = int(pl.split_factor), pl.dim
            idx[d] = [i for k in range(sf) for i in _chunk(_chunk(idx[d], sf, k), m, c)]
        elif pl.is_shard():
            idx[pl.dim] = _chunk(idx[pl.dim], m, c)
        elif not pl.is_replicate():
            raise ValueError(f"a checkpoint cannot place a tensor with placement {pl}")
    return idx


def _runs(seq: Sequence[int]) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of each run of consecutive indices."""
    if isinstance(seq, range) and seq.step == 1:
        return [(0, seq.start, len(seq))] if len(seq) else []
    runs: list[list[int]] = []
    for pos, g in enumerate(seq):
        if runs and runs[-1][1] + runs[-1][2] == g:
            runs[-1][2] += 1
        else:
            runs.append([pos, g, 1])
    return [tuple(r) for r in runs]


def boxes(t: torch.Tensor, name: str = "tensor") -> list[Box]:
    """This rank's piece of `t` as boxes of the full tensor (empty pieces left out)."""
    idx = held_indices(t)
    if [len(i) for i in idx] != list(local(t).shape):
        raise ValueError(f"{name}: cannot place the local piece {list(local(t).shape)} of {t.placements}")
    out = []
    for parts in itertools.product(*(_runs(i) for i in idx)):
        size = tuple(p[2] for p in parts)
        if math.prod(size) > 0 or not size:
            out.append((tuple(p[0] for p in parts), tuple(p[1] for p in parts), size))
    return out


class Writers:
    """Which distinct pieces this rank writes: a piece is written by the rank at coordinate 0
    on every axis over which its tensor is replicated (mesh dims placed Replicate, and the
    stage's axes the tensor's mesh does not span), so each element is written once."""

    def __init__(self, dims: dict[str, int], coords: dict[str, int]):
        self.table, self.coords, self.spans = rank_coords(dims), coords, {}

    def _spanned(self, mesh) -> set[str]:
        ranks = tuple(mesh.mesh.flatten().tolist())
        if ranks not in self.spans:
            self.spans[ranks] = {a for a in REPLICA_AXES if len({self.table[r][a] for r in ranks}) > 1}
        return self.spans[ranks]

    def writes(self, t: torch.Tensor) -> bool:
        spanned: set[str] = set()
        if is_dtensor(t):
            coord = t.device_mesh.get_coordinate()
            if any(not _splits(pl) and c != 0 for pl, c in zip(t.placements, coord)):
                return False
            spanned = self._spanned(t.device_mesh)
        return all(self.coords[a] == 0 for a in REPLICA_AXES if a not in spanned)


def read_into_(dst: torch.Tensor, name: str, files: SliceReader, target: torch.Tensor | None = None) -> None:
    """Fill this rank's piece of `dst` (a DTensor or a plain tensor of the full shape) from
    the regions of `name` it covers; one region in memory at a time. `target`: a tensor of
    the local piece's shape to fill instead (an 8-bit state's codes, checkpoint/optim_state.py)."""
    if files.shape(name) != list(dst.shape):
        raise CheckpointError(f"{name}: the file holds shape {files.shape(name)}, the model needs {list(dst.shape)}")
    target = local(dst) if target is None else target
    with torch.no_grad():
        for lstart, gstart, size in boxes(dst, name):
            piece = files.read(name, gstart, size)
            target[tuple(slice(a, a + n) for a, n in zip(lstart, size))].copy_(piece)


class SliceReader:
    """Regions of full tensors by name, read from the slices on disk with safetensors'
    get_slice (only the intersecting part of each slice). Each file is opened per read, so
    no mapping of a whole file stays resident."""

    def __init__(self, root: str, index: dict[str, dict]):
        self.root, self.index, self.headers = root, index, {}

    def __enter__(self) -> SliceReader:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def shape(self, name: str) -> list[int]:
        return list(self.index[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        first = self.index[name]["slices"][0]
        path = os.path.join(self.root, first["file"])
        if path not in self.headers:
            self.headers[path] = read_header(path)
        return TORCH_DTYPES[self.headers[path][first["key"]]["dtype"]]

    def get(self, name: str) -> torch.Tensor:
        """The full tensor (export, load_model: one tensor at a time)."""
        return self.read(name)

    def read(self, name: str, start: Sequence[int] | None = None, size: Sequence[int] | None = None) -> torch.Tensor:
        """The region [start, start + size) of the full tensor `name`."""
        shape = self.shape(name)
        start, size = list(start or [0] * len(shape)), list(shape if size is None else size)
        out, covered = None, 0
        for s in self.index[name]["slices"]:
            lo = [max(a, b) for a, b in zip(start, s["offset"])]
            hi = [min(a + n, b + m) for a, n, b, m in zip(start, size, s["offset"], s["shape"])]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            with safe_open(os.path.join(self.root, s["file"]), framework="pt", device="cpu") as f:
                if shape:
                    piece = f.get_slice(s["key"])[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, s["offset"]))]
                else:
                    piece = f.get_tensor(s["key"])
            if covered == 0 and lo == start and hi == [a + n for a, n in zip(start, size)]:
                return piece  # one slice holds the whole region: no second buffer
            out = torch.empty(size, dtype=piece.dtype) if out is None else out
            out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, start))] = piece
            covered += math.prod(b - a for a, b in zip(lo, hi))
        if covered != math.prod(size):
            raise CheckpointError(
                f"checkpoint {self.root}: the slices of {name} cover {covered} of the {math.prod(size)} "
                f"elements at {start} size {size} (missing or overlapping slices)"
            )
        return out if out is not None else torch.empty(size, dtype=self.dtype(name))


def full_index(root: str, files: dict[str, str]) -> dict[str, dict]:
    """The slice index of whole tensors stored by name (name -> file): a format-1 checkpoint,
    an import-hf step, a Hugging Face directory."""
    headers: dict[str, dict] = {}
    out = {}
    for name, file in files.items():
        if file not in headers:
            headers[file] = read_header(os.path.join(root, file))
        if name not in headers[file]:
            raise CheckpointError(f"{os.path.join(root, file)}: no tensor {name} (its index says it is there)")
        shape = list(headers[file][name]["shape"])
        whole = {"file": file, "key": name, "offset": [0] * len(shape), "shape": shape}
        out[name] = {"shape": shape, "slices": [whole]}
    return out
