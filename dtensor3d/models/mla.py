"""Multi-head latent attention (DeepSeek-V2/V3) as plain single-device PyTorch, computing
what transformers' DeepseekV3Attention computes, under its parameter names.

The query comes from a low-rank projection (q_a_proj -> q_a_layernorm -> q_b_proj; one
q_proj when q_lora_rank is null). Keys and values come from one compressed latent:
kv_a_proj_with_mqa maps the hidden state to kv_lora_rank latent dims plus qk_rope_head_dim
dims of a RoPE key shared by every head; the latent (after kv_a_layernorm) is expanded by
kv_b_proj into each head's RoPE-free key part (qk_nope_head_dim) and value (v_head_dim). A
head's key is [its nope part, the shared RoPE part]; its query likewise. The RoPE part uses
DeepSeek's interleaved pair layout when rope_interleave is set, and YaRN's mscale also
scales the softmax (models/rope.py `softmax_scale`).

Tensor parallelism shards the heads from outside (q_b_proj / kv_b_proj column-parallel,
o_proj row-parallel: parallel/tensor.py); the local head count is inferred from the
projected width. Context parallelism comes in through `hooks.sequence` as for Llama.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import nn

from .layers import KVCache, ModelHooks, RMSNorm, cached_attention
from .rope import apply_rope, inv_freq, rope_tables, softmax_scale

# transformers builds the latent norms with DeepseekV3RMSNorm's default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, cfg, hooks: ModelHooks):
        super().__init__()
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.latent, self.interleaved, self.sequence = cfg.kv_lora_rank, cfg.rope_interleave, hooks.sequence
        qk, heads, h, bias = self.nope + self.rope, cfg.num_attention_heads, cfg.hidden_size, cfg.attention_bias
        self.freqs, self.rope_scale = inv_freq(cfg, self.rope)  # plain tensors: nothing to shard or save
        # SDPA scales by 1/sqrt(qk); YaRN's mscale changes that, so q carries the ratio.
        self.q_factor = softmax_scale(cfg, qk) * qk**0.5
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.latent + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.latent, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.latent, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, h, bias=bias)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return rearrange(q, "b s (h d) -> b h s d", d=self.nope + self.rope)  # [b, heads, s, qk]

    def forward(
        self,
        x: torch.Tensor,
        cache: KVCache | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As Llama's Attention.forward: `cache` (generation, single device; the keys/values
        cached are expanded per head), `position_ids` / `document_ids` (packed documents)."""
        q_nope, q_rot = self._query(x).split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.latent, self.rope], dim=-1)
        kv = rearrange(self.kv_b_proj(self.kv_a_layernorm(latent)), "b s (h d) -> b h s d", d=self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # [b, heads, s, nope], [b, heads, s, v]
        k_rot = k_rot.unsqueeze(1)  # [b, 1, s, rope]: one RoPE key for every head
        if cache is not None:
            positions = cache.positions(x.shape[1], x.device)
        elif position_ids is not None:
            positions = position_ids
        else:  # the whole sequence, or this rank's part of it under context parallelism
            positions = self.sequence.positions(x.shape[1], x.device)
        cos, sin = rope_tables(self.freqs, self.rope_scale, positions)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        q_rot, k_rot = (apply_rope(t, cos, sin, self.interleaved) for t in (q_rot, k_rot))
        q = torch.cat([q_nope, q_rot], dim=-1)
        if self.q_factor != 1.0:
            q = q * self.q_factor
        k = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)  # [b, heads, s, qk]
        if cache is None:
            out = self.sequence.attention(q, k, v, document_ids)  # [b, heads, s, v]
        else:
            out = cached_attention(q, *cache.update(self, k, v), pad=cache.pad)
        return self.o_proj(rearrange(out, "b h s d -> b s (h d)"))
