"""gpt-oss's expert tensors in Hugging Face's layout: each layer's experts are stacked there as
here ([E, in, out]), but gate and up share one tensor, gate_up_proj [E, hidden, 2 * inter], their
columns interleaved (gate at the even ones, up at the odd ones: transformers' GptOssExperts
takes gate_up[..., ::2] and gate_up[..., 1::2]), and so do their biases, gate_up_proj_bias
[E, 2 * inter]; down_proj [E, inter, hidden] and down_proj_bias [E, hidden] are ours (w2,
w2_bias). The router is `mlp.router` there.

The release's MXFP4 experts (gate_up_proj_blocks / _scales, down_proj_blocks / _scales) are
dequantized on reading, to bf16, by transformers' own code (transformers.integrations.mxfp4,
plain torch: runs on CPU)."""

from __future__ import annotations

import re

import torch

from ..errors import CheckpointError

EXPERT_RE = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.(w[123])(_bias)?$")
THEIRS = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None)}
MXFP4 = ("_blocks", "_scales")


def part(name: str) -> tuple[str, int | None, str] | None:
    """Our expert tensor -> (its tensor there, which interleaved half (0 gate, 1 up; None: all of
    it), our tensor holding the other half); None for any other tensor."""
    m = EXPERT_RE.match(name)
    if not m:
        return None
    proj, half = THEIRS[m[2]]
    partner = f"{m[1]}.block_sparse_moe.experts.{'w3' if m[2] == 'w1' else 'w1'}{m[3] or ''}"
    return f"{m[1]}.mlp.experts.{proj}{m[3] or ''}", half, partner


def plain(name: str) -> str:
    """Any other tensor's name there: the router is `mlp.router`, the rest is under `mlp` as in HFNames."""
    return name.replace(".block_sparse_moe.gate.", ".mlp.router.")


def hf_shape(name: str, shape: list[int]) -> tuple[str, list[int]] | None:
    """(name there, its shape) for our expert tensor `name` of `shape`; None for the up half (written with the gate)."""
    theirs, half, _ = part(name)
    if half == 1:
        return None
    return theirs, shape if half is None else [*shape[:-1], 2 * shape[-1]]


def interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[..., n] and [..., n] -> [..., 2n] with gate at the even columns, up at the odd ones."""
    return torch.stack([gate, up], dim=-1).flatten(-2)


def mxfp4_expected(expected: dict[str, list[int]], index: dict) -> dict[str, list[int]]:
    """The tensors a directory must hold where its experts are MXFP4 (blocks [E, out, in / 32, 16]
    and scales [E, out, in / 32] for each [E, in, out] weight); `expected` unchanged otherwise."""
    out = {}
    for name, shape in expected.items():
        if name + MXFP4[0] in index and name not in index and len(shape) == 3:
            e, d_in, d_out = shape
            out |= {name + MXFP4[0]: [e, d_out, d_in // 32, 16], name + MXFP4[1]: [e, d_out, d_in // 32]}
        else:
            out[name] = shape
    return out


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, where: str) -> torch.Tensor:
    """MXFP4 blocks [E, out, G, 16] (uint8) and scales [E, out, G] -> bf16 [E, G * 32, out]."""
    try:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    except ImportError:
        raise CheckpointError(
            f"{where}: MXFP4 expert weights (*_blocks, *_scales) are dequantized with transformers' "
            "transformers.integrations.mxfp4, which is not installed; pip install transformers, or give the "
            "bf16 release (e.g. save_pretrained of the model loaded with Mxfp4Config(dequantize=True))"
        ) from None
    return convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)


class Reader:
    """Reads our gpt-oss expert tensors from `slices` (an HFSlices: its base reads by their names)."""

    def __init__(self, slices, base):
        self.slices, self.base = slices, base  # base: the plain SliceReader methods, unbound (shape, dtype, read)

    def quantized(self, theirs: str) -> bool:
        return theirs not in self.slices.index and theirs + MXFP4[0] in self.slices.index

    def full_shape(self, theirs: str) -> list[int]:
        if self.quantized(theirs):
            e, d_out, groups, width = self.base.shape(self.slices, theirs + MXFP4[0])
            return [e, groups * width * 2, d_out]
        return self.base.shape(self.slices, theirs)

    def shape(self, name: str) -> list[int]:
        theirs, half, _ = part(name)
        shape = self.full_shape(theirs)
        return shape if half is None else [*shape[:-1], shape[-1] // 2]

    def dtype(self, name: str) -> torch.dtype:
        theirs = part(name)[0]
        return torch.bfloat16 if self.quantized(theirs) else self.base.dtype(self.slices, theirs)

    def read(self, name: str, start=None, size=None) -> torch.Tensor:
        theirs, half, _ = part(name)
        size = list(size or self.shape(name))
        start = list(start or [0] * len(size))
        if half is not None:  # the columns of our half, and the other half's between them
            start[-1], size[-1] = 2 * start[-1], 2 * size[-1]
        if self.quantized(theirs):
            rows = [start[0], size[0]]
            blocks = self._region(theirs + MXFP4[0], rows)
            full = dequantize(blocks, self._region(theirs + MXFP4[1], rows), f"{self.slices.root}: {theirs}")
            got = full[:, start[1] : start[1] + size[1], start[2] : start[2] + size[2]]
        else:
            got = self.base.read(self.slices, theirs, start, size)
        return got if half is None else got[..., half::2].contiguous()

    def _region(self, theirs: str, rows: list[int]) -> torch.Tensor:
        """Experts rows[0] .. rows[0] + rows[1] of a tensor there, whole otherwise."""
        shape = self.base.shape(self.slices, theirs)
        return self.base.read(self.slices, theirs, [rows[0], *[0] * (len(shape) - 1)], [rows[1], *shape[1:]])
