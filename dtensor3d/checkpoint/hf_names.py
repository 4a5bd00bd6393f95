"""Hugging Face names and shapes: our tensor names are LlamaForCausalLM's; experts, stacked
here, are one Linear each there, and Qwen3-MoE's MoE block is `mlp` (`HFNames`, `to_hf_lazy`,
`HFSlices` reading a HF directory by our names). The config defaults transformers assumes. Only safetensors are read."""

from __future__ import annotations

import re

import torch

from ..config.families import FAMILIES
from ..config.hf_config import HF_DEFAULTS, LLAMA_KEYS, MIXTRAL_DEFAULTS, QWEN3_MOE_KEYS  # noqa: F401  (re-exported)
from .check import expected_shapes
from .slices import SliceReader, full_index

HF_SINGLE, HF_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Our stacked experts [E, in, out] <-> one Linear weight [out, in] per expert there.
EXPERTS_RE = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.(w[123])$")
# Each stacked tensor's projection by the family's MoE name (Family.hf_moe): Mixtral's w1/w2/w3,
# or gate_proj/down_proj/up_proj (Qwen3-MoE, DeepSeek-V3, under `mlp`).
PROJ = {"block_sparse_moe": {}, "mlp": {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}}


class HFNames:
    """Our tensor names <-> a family's Hugging Face names: the MoE block is `block_sparse_moe`
    here (Mixtral's) and `Family.hf_moe` there, with `shared_experts` for a shared expert under `mlp`."""

    def __init__(self, family: str):
        self.moe = FAMILIES[family].hf_moe

    def plain(self, name: str) -> str:
        if self.moe == "block_sparse_moe":
            return name
        return name.replace(".block_sparse_moe.shared_expert.", ".mlp.shared_experts.").replace(
            ".block_sparse_moe.", ".mlp."
        )

    def experts(self, name: str, count: int) -> list[str] | None:
        """A stacked expert tensor's per-expert names there; None for any other tensor."""
        m = EXPERTS_RE.match(name)
        if not m:
            return None
        proj = PROJ[self.moe].get(m[2], m[2])
        return [f"{m[1]}.{self.moe}.experts.{e}.{proj}.weight" for e in range(count)]


# ---------------------------------------------------------------- names and shapes


def hf_shapes(cfg) -> dict[str, list[int]]:
    """Parameter shapes by Hugging Face name: ours, except experts one by one."""
    names, out = HFNames(cfg.family), {}
    for name, shape in expected_shapes(cfg).items():
        split = names.experts(name, shape[0]) if EXPERTS_RE.match(name) else None
        if split:
            out.update(dict.fromkeys(split, [shape[2], shape[1]]))
        else:
            out[names.plain(name)] = shape
    return out


def to_hf_lazy(name: str, source: SliceReader, family: str = "llama") -> dict[str, tuple]:
    """One of our tensors as Hugging Face (dtype, shape, produce) entries for `save_tensors`:
    each tensor (each expert of a stacked one) is read when it is written, so an export
    holds one at a time."""
    names, shape, dtype = HFNames(family), source.shape(name), source.dtype(name)
    split = names.experts(name, shape[0]) if EXPERTS_RE.match(name) else None
    if not split:
        return {names.plain(name): (dtype, shape, lambda: source.get(name))}
    _, d_in, d_out = shape

    def expert(e: int) -> torch.Tensor:
        return source.read(name, [e, 0, 0], [1, d_in, d_out])[0].T

    return {key: (dtype, [d_out, d_in], lambda e=e: expert(e)) for e, key in enumerate(split)}


class HFSlices(SliceReader):
    """Our tensors by our names from a Hugging Face directory of `family` (experts stacked),
    any region of them read with get_slice."""

    def __init__(self, root: str, weight_map: dict[str, str], family: str = "llama"):
        super().__init__(root, full_index(root, weight_map))
        self.names = HFNames(family)

    def _expert_keys(self, name: str) -> list[str] | None:
        m = EXPERTS_RE.match(name)
        if not m:
            return None
        proj = PROJ[self.names.moe].get(m[2], m[2])
        prefix = f"{m[1]}.{self.names.moe}.experts."
        count = sum(1 for n in self.index if n.startswith(prefix) and n.endswith(f".{proj}.weight"))
        return self.names.experts(name, count)

    def shape(self, name: str) -> list[int]:
        keys = self._expert_keys(name)
        if keys is None:
            return super().shape(self.names.plain(name))
        d_out, d_in = super().shape(keys[0])
        return [len(keys), d_in, d_out]

    def dtype(self, name: str) -> torch.dtype:
        keys = self._expert_keys(name)
        return super().dtype(keys[0] if keys else self.names.plain(name))

    def read(self, name: str, start=None, size=None) -> torch.Tensor:
        keys = self._expert_keys(name)
        if keys is None:
            return super().read(self.names.plain(name), start, size)
        start, size = list(start or [0, 0, 0]), list(size or self.shape(name))
        pieces = [
            super(HFSlices, self).read(keys[e], [start[2], start[1]], [size[2], size[1]]).T
            for e in range(start[0], start[0] + size[0])
        ]
        return torch.stack(pieces)
