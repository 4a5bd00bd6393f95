"""Hugging Face names and shapes: our tensor names are LlamaForCausalLM's; experts, stacked
here, are one Linear each there, and Qwen3-MoE's MoE block is `mlp` (`HFNames`, `to_hf_lazy`,
`HFSlices` reading a HF directory by our names). The config defaults transformers assumes. Only safetensors are read."""

from __future__ import annotations

import json
import os
import re

import torch

from ..config.families import FAMILIES
from ..config.hf_config import (  # noqa: F401  (re-exported)
    DEEPSEEK_MOE_KEYS,
    HF_DEFAULTS,
    LLAMA_KEYS,
    MIXTRAL_DEFAULTS,
    MLA_DEFAULTS,
    QWEN3_MOE_KEYS,
)
from . import hf_gpt_oss
from .check import expected_shapes
from .slices import SliceReader, full_index

HF_SINGLE, HF_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Our stacked experts [E, in, out] <-> one Linear weight [out, in] per expert there.
EXPERTS_RE = re.compile(r"^(model\.(?:layers|mtp)\.\d+)\.block_sparse_moe\.experts\.(w[123])$")
# Our MTP modules (models/mtp.py) are model.mtp.{i}; there, model.layers.{i} past the last layer (DeepSeek-V3).
MTP, LAYERS = "model.mtp.", "model.layers."
# Each stacked tensor's projection by the family's MoE name (Family.hf_moe): Mixtral's w1/w2/w3,
# or gate_proj/down_proj/up_proj (Qwen3-MoE, DeepSeek-V3, under `mlp`).
PROJ = {"block_sparse_moe": {}, "mlp": {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}}


# Phi-3's fused projections: our separate ones, in the order their rows are stacked there.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
FUSED_RE = re.compile(r"^(model\.layers\.\d+\.(?:self_attn|mlp))\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$")


def fused_part(name: str) -> tuple[str, tuple[str, ...], int] | None:
    """Our q/k/v or gate/up weight -> (the fused tensor's name, our names of its parts, which
    part this is); None for any other tensor."""
    m = FUSED_RE.match(name)
    if not m:
        return None
    fused, parts = next((f, p) for f, p in FUSED.items() if m[2] in p)
    return f"{m[1]}.{fused}.weight", tuple(f"{m[1]}.{p}.weight" for p in parts), parts.index(m[2])


class HFNames:
    """Our tensor names <-> a family's Hugging Face names: the MoE block is `block_sparse_moe`
    here (Mixtral's) and `Family.hf_moe` there, with `shared_experts` for a shared expert under `mlp`."""

    def __init__(self, family: str):
        self.moe = FAMILIES[family].hf_moe
        self.gpt_oss = FAMILIES[family].expert_bias  # gpt-oss's experts and router (checkpoint/hf_gpt_oss.py)

    def plain(self, name: str) -> str:
        name = LAYERS + name[len(MTP) :] if name.startswith(MTP) else name
        name = hf_gpt_oss.plain(name) if self.gpt_oss else name
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
        proj, layer = PROJ[self.moe].get(m[2], m[2]), self.plain(m[1])
        return [f"{layer}.{self.moe}.experts.{e}.{proj}.weight" for e in range(count)]


# ---------------------------------------------------------------- names and shapes


def hf_shapes(cfg) -> dict[str, list[int]]:
    """Parameter shapes by Hugging Face name: ours, except experts one by one."""
    names, out = HFNames(cfg.family), {}
    fused = FAMILIES[cfg.family].fused
    for name, shape in expected_shapes(cfg).items():
        if names.gpt_oss and hf_gpt_oss.part(name):
            out.update(dict([hf_gpt_oss.hf_shape(name, shape)] if hf_gpt_oss.hf_shape(name, shape) else []))
            continue
        split = names.experts(name, shape[0]) if EXPERTS_RE.match(name) else None
        part = fused_part(name) if fused else None
        if part:  # rows stacked in the fused tensor
            rows = out.get(part[0], [0, shape[1]])[0]
            out[part[0]] = [rows + shape[0], shape[1]]
        elif split:
            out.update(dict.fromkeys(split, [shape[2], shape[1]]))
        else:
            out[names.plain(name)] = shape
    return out


def to_hf_lazy(name: str, source: SliceReader, family: str = "llama") -> dict[str, tuple]:
    """One of our tensors as Hugging Face (dtype, shape, produce) entries for `save_tensors`:
    each tensor (each expert of a stacked one) is read when it is written, so an export
    holds one at a time."""
    names, shape, dtype = HFNames(family), source.shape(name), source.dtype(name)
    pair = hf_gpt_oss.part(name) if names.gpt_oss else None
    if pair:  # gpt-oss: gate and up interleaved in one tensor, written with the gate
        theirs, half, partner = pair
        if half is None:
            return {theirs: (dtype, shape, lambda: source.get(name))}
        return (
            {}
            if half
            else {
                theirs: (
                    dtype,
                    hf_gpt_oss.hf_shape(name, shape)[1],
                    lambda: hf_gpt_oss.interleave(source.get(name), source.get(partner)),
                )
            }
        )
    split = names.experts(name, shape[0]) if EXPERTS_RE.match(name) else None
    part = fused_part(name) if FAMILIES[family].fused else None
    if part:  # the first part writes the fused tensor (its rows: every part's), the others nothing
        if part[2]:
            return {}
        rows = sum(source.shape(p)[0] for p in part[1])
        return {part[0]: (dtype, [rows, shape[1]], lambda: torch.cat([source.get(p) for p in part[1]]))}
    if not split:
        return {names.plain(name): (dtype, shape, lambda: source.get(name)), **_mtp_copies(name, source, family)}
    _, d_in, d_out = shape

    def expert(e: int) -> torch.Tensor:
        return source.read(name, [e, 0, 0], [1, d_in, d_out])[0].T

    return {key: (dtype, [d_out, d_in], lambda e=e: expert(e)) for e, key in enumerate(split)}


def _mtp_copies(name: str, source: SliceReader, family: str) -> dict[str, tuple]:
    """DeepSeek-V3's MTP layer model.layers.{i} also holds the embedding and the head (the main
    model's, written beside its eh_proj), so an imported directory round-trips tensor for tensor."""
    m = MTP_EH_RE.match(name)
    if not m or not FAMILIES[family].prediction_layers:
        return {}
    head = "model.embed_tokens.weight" if "lm_head.weight" not in source.index else "lm_head.weight"
    copies = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": head}
    return {
        f"{LAYERS}{m[1]}.{theirs}": (source.dtype(ours), source.shape(ours), lambda ours=ours: source.get(ours))
        for theirs, ours in copies.items()
    }


MTP_EH_RE = re.compile(r"^model\.mtp\.(\d+)\.eh_proj\.weight$")


class HFSlices(SliceReader):
    """Our tensors by our names from a Hugging Face directory of `family` (experts stacked),
    any region of them read with get_slice."""

    def __init__(self, root: str, weight_map: dict[str, str], family: str = "llama"):
        super().__init__(root, full_index(root, weight_map))
        self.names = HFNames(family)
        self.fused, self.root = FAMILIES[family].fused, root
        self.gpt_oss = hf_gpt_oss.Reader(self, SliceReader) if self.names.gpt_oss else None

    def _part(self, name: str) -> tuple[str, int, int] | None:
        """A fused tensor's part: (the fused name, its first row there, its rows), by the
        head counts of the directory's config.json; None for any other tensor."""
        part = fused_part(name) if self.fused else None
        if part is None:
            return None
        with open(os.path.join(self.root, "config.json"), encoding="utf-8") as f:
            hf = json.load(f)
        rows_all = super().shape(part[0])[0]
        if part[0].endswith("gate_up_proj.weight"):
            sizes = [rows_all // 2] * 2
        else:
            hd = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
            kv = (hf.get("num_key_value_heads") or hf["num_attention_heads"]) * hd
            sizes = [rows_all - 2 * kv, kv, kv]
        return part[0], sum(sizes[: part[2]]), sizes[part[2]]

    def _expert_keys(self, name: str) -> list[str] | None:
        m = EXPERTS_RE.match(name)
        if not m:
            return None
        proj = PROJ[self.names.moe].get(m[2], m[2])
        prefix = f"{self.names.plain(m[1])}.{self.names.moe}.experts."
        count = sum(1 for n in self.index if n.startswith(prefix) and n.endswith(f".{proj}.weight"))
        return self.names.experts(name, count)

    def _pair(self, name: str) -> bool:
        return self.gpt_oss is not None and hf_gpt_oss.part(name) is not None

    def shape(self, name: str) -> list[int]:
        if self._pair(name):
            return self.gpt_oss.shape(name)
        part = self._part(name)
        if part:
            return [part[2], super().shape(part[0])[1]]
        keys = self._expert_keys(name)
        if keys is None:
            return super().shape(self.names.plain(name))
        d_out, d_in = super().shape(keys[0])
        return [len(keys), d_in, d_out]

    def dtype(self, name: str) -> torch.dtype:
        if self._pair(name):
            return self.gpt_oss.dtype(name)
        part = self._part(name)
        if part:
            return super().dtype(part[0])
        keys = self._expert_keys(name)
        return super().dtype(keys[0] if keys else self.names.plain(name))

    def read(self, name: str, start=None, size=None) -> torch.Tensor:
        if self._pair(name):
            return self.gpt_oss.read(name, start, size)
        part = self._part(name)
        if part:
            start, size = list(start or [0, 0]), list(size or self.shape(name))
            return super().read(part[0], [part[1] + start[0], start[1]], size)
        keys = self._expert_keys(name)
        if keys is None:
            return super().read(self.names.plain(name), start, size)
        start, size = list(start or [0, 0, 0]), list(size or self.shape(name))
        pieces = [
            super(HFSlices, self).read(keys[e], [start[2], start[1]], [size[2], size[1]]).T
            for e in range(start[0], start[0] + size[0])
        ]
        return torch.stack(pieces)
