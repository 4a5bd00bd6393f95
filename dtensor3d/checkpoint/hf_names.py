"""Hugging Face names and shapes: our tensor names are LlamaForCausalLM's; Mixtral's experts,
stacked here, are one Linear each there (`to_hf`, `HFSlices` reading a HF directory by our
names). The config defaults transformers assumes. Only safetensors are read."""

from __future__ import annotations

import re

import torch

from ..config.hf_config import HF_DEFAULTS, LLAMA_KEYS, MIXTRAL_DEFAULTS, MLA_DEFAULTS  # noqa: F401  (re-exported)
from .check import expected_shapes
from .slices import SliceReader, full_index

HF_SINGLE, HF_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Our stacked experts [E, in, out] <-> Mixtral's one Linear weight [out, in] per expert.
EXPERTS_RE = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(w[123])$")


# ---------------------------------------------------------------- names and shapes


def hf_shapes(cfg) -> dict[str, list[int]]:
    """Parameter shapes by Hugging Face name: ours, except Mixtral's experts one by one."""
    out = {}
    for name, shape in expected_shapes(cfg).items():
        m = EXPERTS_RE.match(name)
        if m:
            out.update({f"{m[1]}.{e}.{m[2]}.weight": [shape[2], shape[1]] for e in range(shape[0])})
        else:
            out[name] = shape
    return out


def to_hf(name: str, full: torch.Tensor) -> dict[str, torch.Tensor]:
    """One of our full tensors as Hugging Face tensors (stacked experts split and transposed)."""
    m = EXPERTS_RE.match(name)
    if not m:
        return {name: full}
    return {f"{m[1]}.{e}.{m[2]}.weight": w.T.contiguous() for e, w in enumerate(full.unbind(0))}


def to_hf_lazy(name: str, source: SliceReader) -> dict[str, tuple]:
    """Like `to_hf`, as (dtype, shape, produce) entries for `save_tensors`: each tensor (each
    expert of a stacked one) is read when it is written, so an export holds one at a time."""
    m, shape, dtype = EXPERTS_RE.match(name), source.shape(name), source.dtype(name)
    if not m:
        return {name: (dtype, shape, lambda: source.get(name))}
    _, d_in, d_out = shape

    def expert(e: int) -> torch.Tensor:
        return source.read(name, [e, 0, 0], [1, d_in, d_out])[0].T

    return {f"{m[1]}.{e}.{m[2]}.weight": (dtype, [d_out, d_in], lambda e=e: expert(e)) for e in range(shape[0])}


class HFSlices(SliceReader):
    """Our tensors by our names from a Hugging Face directory (Mixtral's experts stacked),
    any region of them read with get_slice."""

    def __init__(self, root: str, weight_map: dict[str, str]):
        super().__init__(root, full_index(root, weight_map))

    def _expert_keys(self, name: str) -> list[str] | None:
        m = EXPERTS_RE.match(name)
        if not m:
            return None
        count = sum(1 for n in self.index if n.startswith(m[1] + ".") and n.endswith(f".{m[2]}.weight"))
        return [f"{m[1]}.{e}.{m[2]}.weight" for e in range(count)]

    def shape(self, name: str) -> list[int]:
        keys = self._expert_keys(name)
        if keys is None:
            return super().shape(name)
        d_out, d_in = super().shape(keys[0])
        return [len(keys), d_in, d_out]

    def dtype(self, name: str) -> torch.dtype:
        keys = self._expert_keys(name)
        return super().dtype(keys[0] if keys else name)

    def read(self, name: str, start=None, size=None) -> torch.Tensor:
        keys = self._expert_keys(name)
        if keys is None:
            return super().read(name, start, size)
        start, size = list(start or [0, 0, 0]), list(size or self.shape(name))
        pieces = [
            super(HFSlices, self).read(keys[e], [start[2], start[1]], [size[2], size[1]]).T
            for e in range(start[0], start[0] + size[0])
        ]
        return torch.stack(pieces)
