"""Llama as plain single-device PyTorch: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Parameter names match Hugging Face `LlamaForCausalLM` one to one. There is no distributed
code here: tensor parallelism changes the linear layers from outside, so the attention
infers its local head count from the projected width (`-1` in the reshape). Pipeline
stages are copies of the model with some submodules set to None (`keep_only`); the
forward skips whatever is missing, and layer names keep their global index.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.utils.checkpoint import checkpoint

from .moe import MoE


def is_moe_layer(cfg, index: int) -> bool:
    """Layers with experts: all of them when the model has experts, unless moe_layers lists some."""
    if not cfg.num_local_experts:
        return False
    return cfg.moe_layers is None or index in cfg.moe_layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.type_as(x)


def rope_tables(head_dim: int, positions: torch.Tensor, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [seq, head_dim] for the given (global) token positions."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    angles = torch.outer(positions.float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; Hugging Face's rotate-half convention."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).type_as(x)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: [b, h, s, d]; k, v: [b, kv_h, s, d] -> [b, h, s, d]. Grouped-query attention by
    the kernel itself (no repeated K/V kept for backward)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.rope_theta = cfg.rope_theta
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=False)
        # The attention kernel; context parallelism swaps it for its own.
        self.attention_fn = causal_attention

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        q, k, v = (
            rearrange(p(x), "b s (h d) -> b h s d", d=self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        if positions is None:  # the whole sequence (it may have been gathered from tp ranks)
            positions = torch.arange(q.shape[2], device=q.device)
        cos, sin = rope_tables(self.head_dim, positions, self.rope_theta)
        q, k = apply_rope(q, cos.to(q.dtype), sin.to(q.dtype)), apply_rope(k, cos.to(k.dtype), sin.to(k.dtype))
        out = self.attention_fn(q, k, v)
        return self.o_proj(rearrange(out, "b h s d -> b s (h d)"))


class MLP(nn.Module):
    def __init__(self, cfg, intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    # Set from outside (`recompute_layer`): keep only the block's input for backward and
    # recompute the rest. The maths is unchanged.
    recompute = False

    def __init__(self, cfg, moe: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Mixtral's name for a mixture-of-experts feed-forward, Llama's for a dense one.
        if moe:
            self.block_sparse_moe = MoE(cfg)
        else:
            self.mlp = MLP(cfg)

    @property
    def feed_forward(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            out = checkpoint(self._forward, x, positions, use_reentrant=False)
        else:
            out = self._forward(x, positions)
        if hasattr(self, "block_sparse_moe"):
            self.block_sparse_moe.record()
        return out

    def _forward(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions)
        return x + self.feed_forward(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # A ModuleDict keyed by the global layer index: a pipeline stage drops layers and the
        # rest keep their names (model.layers.7...), like nn.ModuleList's.
        self.layers = nn.ModuleDict(
            {str(i): DecoderLayer(cfg, moe=is_moe_layer(cfg, i)) for i in range(cfg.num_hidden_layers)}
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Global positions of this rank's tokens; context parallelism sets them per step.
        self.positions: torch.Tensor | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            h = self.embed_tokens(h)
        for layer in self.layers.values():
            h = layer(h, self.positions)
        if self.norm is not None:
            h = self.norm(h)
        return h


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [b, s]) -> logits [b, s, vocab] (or hidden states on an inner stage)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model(input_ids)
        return self.lm_head(h) if self.lm_head is not None else h

    def keep_only(self, layers: range, first: bool, last: bool) -> LlamaForCausalLM:
        """Turn this model into one pipeline stage: `layers` (global indices), plus the
        embedding on the first stage and the final norm and head on the last."""
        for i in list(self.model.layers.keys()):
            if int(i) not in layers:
                del self.model.layers[i]
        if not first:
            self.model.embed_tokens = None
        if not last:
            self.model.norm = None
            self.lm_head = None
        return self


def init_std(name: str) -> float | None:
    """Initial std of a parameter by name; None means ones (norm weights)."""
    return None if name.endswith("norm.weight") else 0.02
