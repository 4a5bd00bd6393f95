"""optimizer.state_dtype: bfloat16 | 8bit. AdamW's moments (and Muon's momentum buffer,
training/muon.py) in bf16 or in torchao's block-wise 8-bit `OptimState8bit`, updated by
torchao's own `single_param_adam` (torchao.optim's `_AdamW` and `AdamW8bit`): the moments are
read into fp32, the update is computed in fp32 and the moments written back rounded (bf16:
to nearest; 8bit: the nearest code of each 256-element block, scaled by its absmax). The
weights stay fp32 master weights, so the update itself is not rounded: torchao's stochastic
rounding applies to bf16 weights only (`bf16_stochastic_round`), which dtensor3d does not keep.

What differs from torchao's classes, and why:

- Which parameters get 8-bit blocks. torchao decides per local shard (>= 4096 elements and a
  multiple of the block), so the ranks of one sharded parameter can disagree, and its blocks
  are runs of the local shard, cut differently on every mesh. Here a parameter's states are
  quantised only when the whole parameter has >= 4096 elements and, on every rank of its mesh,
  each block is a 256-element run of the full tensor that starts at a multiple of 256
  (`blocks_align`): then the blocks are the full tensor's, one set for every mesh that keeps
  them, and a checkpoint saves one codes tensor and one scale per block (checkpoint/optim_state.py).
  Other parameters keep fp32 moments, as torchao keeps its small tensors'.
- The step runs eagerly on CPU: torchao compiles `single_param_adam` once per parameter shape
  (about 14 s each on this CPU), the same function; on CUDA torchao's compiled step runs.
- The loop writes each group's scheduled lr as a float (training/train.py); torchao reads a
  tensor lr, so the step wraps it for the step's duration.
"""

from __future__ import annotations

import itertools
import math

import torch
from torchao.optim import AdamW8bit, _AdamW
from torchao.optim.adam import single_param_adam
from torchao.optim.subclass_8bit import OptimState8bit

from ..parallel.shards import is_dtensor, local

BLOCK = 256  # torchao's AdamW8bit block size
MIN_NUMEL = 4096  # torchao's (bitsandbytes') smallest quantised tensor


def _wrap(out: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A state piece placed like its parameter (torchao's `_new_buffer` does the same)."""
    if not is_dtensor(p):
        return out
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(out, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _coord_aligned(idx: list, shape: tuple[int, ...], block: int) -> bool:
    """Whether a piece (global indices per dim, slices.held_indices) is a union of aligned
    `block`-element runs of the flattened full tensor (sufficient test: each dim's offset is)."""
    from ..checkpoint.slices import _runs

    full = [len(i) == n for i, n in zip(idx, shape)]
    k = max((d for d, f in enumerate(full) if not f), default=None)
    if k is None:
        return math.prod(shape) % block == 0
    inner = math.prod(shape[k + 1 :])
    if any((g * inner) % block or (n * inner) % block for _, g, n in _runs(idx[k])):
        return False
    strides = [math.prod(shape[d + 1 :]) for d in range(k)]
    return all(s % block == 0 or all(i * s % block == 0 for i in idx[d]) for d, s in enumerate(strides))


def blocks_align(p: torch.Tensor, block: int = BLOCK) -> bool:
    """Whether `p`'s 8-bit states are the full tensor's blocks on every rank (module docstring)."""
    if p.numel() < MIN_NUMEL:
        return False
    if not is_dtensor(p):
        return p.numel() % block == 0
    from ..checkpoint.slices import held_indices

    coords = itertools.product(*(range(n) for n in p.device_mesh.shape))
    return all(_coord_aligned(held_indices(p, list(c)), tuple(p.shape), block) for c in coords)


class _TorchaoStep:
    """torchao's AdamW step with a float lr and an eager CPU path (module docstring)."""

    def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        lrs = [g["lr"] for g in self.param_groups]
        for g in self.param_groups:
            g["lr"] = torch.tensor(float(g["lr"]), dtype=torch.float32)
        try:
            if any(local(p).is_cuda for g in self.param_groups for p in g["params"]):
                return super().step(closure)
            self._eager_step()
        finally:
            for g, lr in zip(self.param_groups, lrs):
                g["lr"] = lr

    def _eager_step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = self._new_buffer(p, True)
                    state["exp_avg_sq"] = self._new_buffer(p, False)
                state["step"] += 1
                beta1, beta2 = group["betas"]
                single_param_adam(
                    local(p.detach()),
                    local(p.grad),
                    state["step"],
                    local(state["exp_avg"]),
                    local(state["exp_avg_sq"]),
                    None,
                    group["lr"],
                    beta1,
                    beta2,
                    group["weight_decay"],
                    group["eps"],
                    True,
                    False,
                )


class BF16StateAdamW(_TorchaoStep, _AdamW):
    """torchao's `_AdamW` with both moments in bf16 (torchao keeps them in the weight's dtype)."""

    def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
        return _wrap(torch.zeros_like(local(p), dtype=torch.bfloat16), p)


class Int8StateAdamW(_TorchaoStep, AdamW8bit):
    """torchao's `AdamW8bit`, its blocks the full tensor's (`blocks_align`) or fp32 moments."""

    def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
        piece = local(p)
        if piece.numel() and blocks_align(p, self.block_size):  # OptimState8bit cannot be empty (FSDP's empty shard)
            out = OptimState8bit.zeros(piece.shape, signed, self.block_size, piece.device, dtype=piece.dtype)
        else:
            out = torch.zeros_like(piece)
        return _wrap(out, p)


def low_precision_adamw(param_groups: list[dict], opt) -> torch.optim.Optimizer:
    """optimizer.state_dtype bfloat16 or 8bit: AdamW over `param_groups` (training/optim.py's)."""
    cls = BF16StateAdamW if opt.state_dtype == "bfloat16" else Int8StateAdamW
    return cls(param_groups, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
