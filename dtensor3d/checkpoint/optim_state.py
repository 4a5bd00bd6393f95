"""Optimizer states as they are held (optimizer.state_dtype, training/optim_lowp.py): fp32 and
bf16 moments are saved in their own dtype, sliced like their parameter; torchao's 8-bit
states (`OptimState8bit`: uint8 codes shaped like the parameter, one fp32 absmax per block of
256) as two tensors: "<param>.<key>" the codes, sliced like the parameter, and
"<param>.<key>_scale" the scales, 1-D, one per block of the flattened full tensor. The blocks
are the full tensor's (optim_lowp.blocks_align), so a rank's blocks are runs of that 1-D
tensor and any mesh whose blocks also align reads its codes and scales back bitwise. A rank
holding fp32 moments where the saved ones are 8-bit (or the reverse) dequantises (or
quantises) them: the value of element i is qmap[code_i] * scale[i // 256].
"""

from __future__ import annotations

import torch

from ..parallel.shards import local
from .slices import SliceReader, _runs, boxes, held_indices, read_into_

SCALE = "_scale"  # "<param>.<key>_scale": an 8-bit state's block scales
BLOCK = 256  # training/optim_lowp.BLOCK (torchao's AdamW8bit default, the block every 8-bit state here has)


def quantised(t: torch.Tensor) -> bool:
    """Whether a state is torchao's 8-bit blocks (a DTensor's local piece, or the tensor)."""
    return hasattr(local(t), "codes")


def new_state(optimizer, p: torch.Tensor, key: str) -> torch.Tensor:
    """The zero state `key` the optimizer would make for `p` (a checkpoint fills it in): a
    moment or Muon's momentum buffer in optimizer.state_dtype (optim_lowp's `_new_buffer`:
    bf16, torchao's 8-bit blocks); fp32 for torch's AdamW."""
    inner = getattr(optimizer, "adamw", optimizer)  # training/muon.py's MuonAdamW keeps its AdamW here
    if hasattr(inner, "_new_buffer"):
        return inner._new_buffer(p, key != "exp_avg_sq")
    return torch.zeros_like(p)


def _flat_index(t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Global flat indices of the local elements at local flat `positions`."""
    idx, shape = held_indices(t), list(t.shape)
    coords = torch.unravel_index(positions, list(local(t).shape))
    out, stride = torch.zeros_like(positions), 1
    for d in reversed(range(len(shape))):
        held = torch.as_tensor(list(idx[d]), dtype=torch.int64)
        out += held[coords[d]] * stride
        stride *= shape[d]
    return out


def _block_runs(t: torch.Tensor, block: int) -> list[tuple[int, int, int]]:
    """(local block, global block, count) of each run of this rank's blocks in the full tensor's."""
    n = local(t).numel()
    return _runs((_flat_index(t, torch.arange(0, n, block)) // block).tolist())


def add_state(add, name: str, value: torch.Tensor) -> None:
    """Call `add(name, tensor, piece, boxes)` for each tensor this state is saved as."""
    piece = local(value).detach()
    if not quantised(value):
        add(name, value, piece, boxes(value, name))
        return
    add(name, value, piece.codes, boxes(value, name))
    scale_boxes = [((lb,), (gb,), (n,)) for lb, gb, n in _block_runs(value, BLOCK)]  # none for an empty shard
    add(name + SCALE, torch.empty(value.numel() // BLOCK, device="meta"), piece.scale, scale_boxes)


def load_state(dst: torch.Tensor, name: str, files: SliceReader) -> None:
    """Fill this rank's piece of the state `dst` (optim.new_state's) from `name` on disk."""
    saved_8bit = name + SCALE in files.index
    if quantised(dst) and saved_8bit:
        q = local(dst)
        read_into_(dst, name, files, target=q.codes)
        if files.shape(name + SCALE) == [dst.numel() // BLOCK]:
            for lb, gb, n in _block_runs(dst, BLOCK):
                q.scale[lb : lb + n].copy_(files.read(name + SCALE, [gb], [n]))
            return
    if not saved_8bit and not quantised(dst):
        read_into_(dst, name, files)  # fp32 or bf16 on disk into fp32 or bf16
        return
    if saved_8bit:
        values = _dequantised(dst, name, files)
    else:
        values = torch.empty(local(dst).shape, dtype=files.dtype(name))
        read_into_(dst, name, files, target=values)
    local(dst).copy_(values)  # into 8-bit blocks: quantised by torchao's copy_


def _dequantised(dst: torch.Tensor, name: str, files: SliceReader) -> torch.Tensor:
    """This rank's piece of a saved 8-bit state as fp32 values (qmap[code] * its block's scale)."""
    from torchao.optim.subclass_8bit import get_qmap_signed, get_qmap_unsigned

    codes = torch.empty(local(dst).shape, dtype=torch.uint8)
    read_into_(dst, name, files, target=codes)
    qmap = torch.tensor(get_qmap_unsigned() if name.endswith("exp_avg_sq") else get_qmap_signed())
    scales = files.read(name + SCALE)
    where = _flat_index(dst, torch.arange(codes.numel())).view(codes.shape) // BLOCK
    return qmap[codes.long()] * scales[where]
