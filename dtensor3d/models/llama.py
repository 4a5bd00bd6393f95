"""Llama as plain single-device PyTorch: RMSNorm, RoPE, grouped-query attention, SwiGLU,
and Mixtral-style mixture-of-experts layers (models/moe.py).

Parameter names match Hugging Face `LlamaForCausalLM` (and `MixtralForCausalLM`'s router
and norms) one to one. There is no distributed code here: tensor parallelism changes the
linear layers from outside, so the attention infers its local head count from the
projected width (`-1` in the reshape); what context and expert parallelism change inside
comes in as `ModelHooks` (models/layers.py). Pipeline stages are copies of the model with
some submodules set to None (`keep_only`); the forward skips whatever is missing, and
layer names keep their global index.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import nn
from torch.utils.checkpoint import checkpoint

from .layers import MLP, KVCache, ModelHooks, RMSNorm, cached_attention, mask_padded_vocab, recompute_context
from .mla import MultiHeadLatentAttention
from .moe import MoE
from .mtp import make_mtp_layer, mtp_forward, mtp_token_ids
from .rope import apply_rope, inv_freq, rope_tables


def _rope_part(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dims: int) -> torch.Tensor:
    """RoPE on x's first `dims` head dims; the rest pass through (partial rotary)."""
    if dims == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :dims], cos, sin), x[..., dims:]], dim=-1)


def _norm(cfg, dim: int) -> RMSNorm:
    """An RMSNorm of the config's kind: x·w, or x·(1+w) (Gemma 3: norm_offset)."""
    return RMSNorm(dim, cfg.rms_norm_eps, offset=cfg.norm_offset)


class Attention(nn.Module):
    """Grouped-query attention; the config's switches add q/k/v (and o) biases and per-head
    q/k RMSNorm (Qwen3), and choose the RoPE scaling (models/rope.py)."""

    def __init__(self, cfg, hooks: ModelHooks, index: int = 0):
        super().__init__()
        hd, qkv_bias = cfg.head_dim, cfg.qkv_bias
        self.head_dim, self.sequence = hd, hooks.sequence
        self.window = cfg.layer_window(index)  # sliding-window attention in this layer, or None
        self.rope = cfg.layer_rope(index)  # False: a NoPE layer (SmolLM3)
        # a plain tensor: no buffer to shard or save; over the first rotary_dim dims (GLM-4.5: part of each head)
        self.freqs, self.rope_scale = inv_freq(cfg.rope_of(index), cfg.rotary_dim)
        self.rotary_dim = cfg.rotary_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:  # per head (Qwen3), or over the whole projection (OLMo 2)
            whole = cfg.qk_norm_whole
            self.q_norm = _norm(cfg, cfg.num_attention_heads * hd if whole else hd)
            self.k_norm = _norm(cfg, cfg.num_key_value_heads * hd if whole else hd)
            self.norm_whole = whole
        # Gemma 3's query_pre_attn_scalar: scores scaled by its -1/2 power, not head_dim's
        self.q_scale = (hd / cfg.query_pre_attn_scalar) ** 0.5 if cfg.query_pre_attn_scalar else 1.0
        if cfg.sinks:  # gpt-oss: a learned logit per head in each row's softmax (tensor parallelism splits it)
            self.sinks = nn.Parameter(torch.empty(cfg.num_attention_heads))

    def forward(
        self,
        x: torch.Tensor,
        cache: KVCache | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`cache` (generation, single device): x holds the tokens after cache.length; their
        keys/values join the cache and they attend to every cached token. `position_ids`,
        `document_ids` [b, s] (packed documents, Hugging Face's position_ids meaning): RoPE
        positions restarting at each document, and attention within each document."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if hasattr(self, "q_norm") and self.norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (rearrange(t, "b s (h d) -> b h s d", d=self.head_dim) for t in (q, k, v))
        if hasattr(self, "q_norm") and not self.norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        if cache is not None:
            positions = cache.positions(q.shape[2], q.device)
        elif position_ids is not None:
            positions = position_ids
        else:  # the whole sequence here, or this rank's part of it under context parallelism
            positions = self.sequence.positions(q.shape[2], q.device)
        if self.rope:
            # in the residual stream's dtype, as transformers rotates (fp32 under one process's bf16
            # autocast, whose bf16 q / k would round each product), then back to q's dtype
            cos, sin = (c.to(x.dtype) for c in rope_tables(self.freqs, self.rope_scale, positions))
            q, k = (_rope_part(t, cos, sin, self.rotary_dim).to(t.dtype) for t in (q, k))
        if self.q_scale != 1.0:
            q = q * self.q_scale
        sinks = getattr(self, "sinks", None)
        # this rank's heads' (tensor parallelism), asked of the type: under torch.compile a DTensor parameter's
        # hasattr is False
        sinks = sinks.to_local() if hasattr(type(sinks), "to_local") else sinks
        if cache is None:
            out = self.sequence.attention(q, k, v, document_ids, window=self.window, **_given(sinks=sinks))
        else:  # [b, h, s, d]
            kept = cache.update(self, k, v, self.window)
            out = cached_attention(q, *kept, window=self.window, sinks=sinks, pad=cache.pad)
        return self.o_proj(rearrange(out, "b h s d -> b s (h d)"))


def _given(**kwargs) -> dict:
    """The keywords that are not None (a layout's attention takes `sinks` only where the model has them)."""
    return {key: value for key, value in kwargs.items() if value is not None}


class DecoderLayer(nn.Module):
    def __init__(self, cfg, hooks: ModelHooks, moe: bool = False, index: int = 0):
        super().__init__()
        self.recompute = hooks.recompute  # none | full | selective
        # Llama: norms before attention and MLP; OLMo 2 (post_norms): after them, none before;
        # Gemma 3 (sandwich_norms): both, by Hugging Face's names.
        self.after = cfg.post_norms or cfg.sandwich_norms
        if not cfg.post_norms:
            self.input_layernorm = _norm(cfg, cfg.hidden_size)
        self.self_attn = MultiHeadLatentAttention(cfg, hooks) if cfg.mla else Attention(cfg, hooks, index)
        self.post_attention_layernorm = _norm(cfg, cfg.hidden_size)
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = _norm(cfg, cfg.hidden_size)
        if self.after:
            self.post_feedforward_layernorm = _norm(cfg, cfg.hidden_size)
        # Mixtral's name for a mixture-of-experts feed-forward, Llama's for a dense one.
        if moe:
            self.block_sparse_moe = MoE(cfg, hooks)
        else:
            self.mlp = MLP(cfg)

    @property
    def feed_forward(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, **docs: torch.Tensor) -> torch.Tensor:
        """`docs`: position_ids and document_ids of packed documents (Attention.forward)."""
        if self.recompute != "none" and torch.is_grad_enabled() and cache is None:
            # full: torch's default context, not passed (torch.compile refuses a context_fn
            # it cannot trace, torch's own noop_context_fn included)
            extra = {"context_fn": recompute_context(self.recompute)} if self.recompute == "selective" else {}
            out = checkpoint(self._forward, x, None, use_reentrant=False, **extra, **docs)
        else:
            out = self._forward(x, cache, **docs)
        if hasattr(self, "block_sparse_moe"):
            self.block_sparse_moe.record()
        return out

    def _forward(self, x: torch.Tensor, cache: KVCache | None = None, **docs: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        # Training calls the attention with one positional input (the documents' ids, and
        # generation's cache, as keywords): tensor parallelism's input styles (sequence
        # parallelism's gather) are written for exactly that, and pass keywords through.
        h = self.self_attn(h, **docs) if cache is None else self.self_attn(h, cache=cache)
        if not self.after:
            x = x + h
            return x + self.feed_forward(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(h)
        h = self.pre_feedforward_layernorm(x) if hasattr(self, "pre_feedforward_layernorm") else x
        return x + self.post_feedforward_layernorm(self.feed_forward(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg, hooks: ModelHooks):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)
        # A ModuleDict keyed by the global layer index: a pipeline stage drops layers and the
        # rest keep their names (model.layers.7...), like nn.ModuleList's.
        self.layers = nn.ModuleDict(
            {str(i): DecoderLayer(cfg, hooks, moe=cfg.is_moe_layer(i), index=i) for i in range(cfg.num_hidden_layers)}
        )
        self.norm = _norm(cfg, cfg.hidden_size)
        self.mtp_embed_tokens = None  # a pipeline's last stage: its copy of embed_tokens for MTP (keep_only)
        self.mtp_shares_head = False  # whether that copy is the tied head's parameter (keep_only)
        n, depth = cfg.num_hidden_layers, cfg.num_nextn_predict_layers  # MTP modules (models/mtp.py), or None
        self.mtp = (
            nn.ModuleDict({str(i): make_mtp_layer(DecoderLayer, _norm, cfg, hooks, i) for i in range(n, n + depth)})
            if depth
            else None
        )

    def forward(
        self, h: torch.Tensor, cache: KVCache | None = None, keep: list | None = None, **docs: torch.Tensor
    ) -> torch.Tensor:
        """`keep`: a list that receives the last decoder layer's output, before the final norm (MTP)."""
        if self.embed_tokens is not None:
            h = self.embed_tokens(h)  # [b, s] -> [b, s, hidden]
            if self.cfg.embed_scale:  # Gemma 3: times sqrt(hidden), rounded to the weights' dtype
                h = h * torch.tensor(self.cfg.hidden_size**0.5, dtype=h.dtype)
        for layer in self.layers.values():
            h = layer(h, **docs) if cache is None else layer(h, cache)
        if keep is not None:
            keep.append(h)
        if self.norm is not None:
            h = self.norm(h)
        return h


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [b, s]) -> logits [b, s, vocab] (or hidden states on an inner stage).

    `hooks`: what a parallelism changes inside (models/layers.py); None: single device."""

    def __init__(self, cfg, hooks: ModelHooks | None = None):
        super().__init__()
        self.cfg = cfg
        self.hooks = hooks or ModelHooks()
        self.model = LlamaModel(cfg, self.hooks)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.padded_vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        mtp_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`cache`: generation's KV cache (models/layers.py); input_ids are then the tokens
        after the cached ones, and the cache advances past them. `position_ids`,
        `document_ids` [b, s]: packed documents (each token attends only to earlier tokens of
        its document; RoPE positions restart at each). `mtp_ids` [b, s, D]: the tokens k ahead
        of each position for MTP depth k (models/mtp.py's mtp_token_ids, made from the whole
        window: a pipeline's last stage and a context-parallel rank's chunks do not hold them);
        None: from input_ids."""
        if cache is None:
            given = {"position_ids": position_ids, "document_ids": document_ids}
            docs = {key: t for key, t in given.items() if t is not None}
            if self._mtp_active():
                return self._with_mtp(input_ids, docs, mtp_ids)
            h = self.model(input_ids, **docs)
        else:
            h = self.model(input_ids, cache)
            cache.length += input_ids.shape[1]
        if self.lm_head is None:
            return h
        return mask_padded_vocab(self.lm_head(h), self.cfg.vocab_size, self.hooks)  # [b, s, padded vocab]

    def _mtp_active(self) -> bool:
        """MTP runs in training only (a grad-enabled forward in train mode); validation, eval and
        generate see the main model's logits alone."""
        return self.model.mtp is not None and self.training and torch.is_grad_enabled()

    def _with_mtp(self, input_ids: torch.Tensor, docs: dict, mtp_ids: torch.Tensor | None) -> torch.Tensor:
        """[b, s, 1 + D, padded vocab]: the main logits, then each MTP depth's (models/mtp.py)."""
        keep: list = []
        if mtp_ids is None:
            mtp_ids = mtp_token_ids(input_ids, self.cfg.num_nextn_predict_layers)
        h = self.model(input_ids, keep=keep, **docs)
        h0 = keep[0] if self.cfg.mtp_hidden == "pre_norm" else h
        hs = [h, *mtp_forward(self.model, mtp_ids, h0, **docs)]
        return torch.stack([mask_padded_vocab(self.lm_head(x), self.cfg.vocab_size, self.hooks) for x in hs], dim=2)

    def keep_only(self, layers: range, first: bool, last: bool, split_backward: bool = False) -> LlamaForCausalLM:
        """Turn this model into one pipeline stage: `layers` (global indices), plus the
        embedding on the first stage and the final norm and head on the last.
        `split_backward`: the stage's schedule computes weight gradients apart from input
        gradients (zbv, dualpipev: torch's stage_backward_weight), which cannot take one
        parameter used at two sites of a stage, so MTP's copy of a tied embedding is then a
        parameter of its own rather than the head's (parallel/tied.py sums all the copies)."""
        for i in list(self.model.layers.keys()):
            if int(i) not in layers:
                del self.model.layers[i]
        if last and not first and self.model.mtp is not None:
            # MTP shares the input embedding: the last stage keeps its own copy under another
            # name (a tied head's parameter, where tied), saved and loaded as the embedding
            # (models.stored_name); parallel/tied.py sums the copies' gradients
            embed = self.model.embed_tokens
            own = split_backward and self.cfg.tie_word_embeddings
            copy = nn.Embedding(*embed.weight.shape, device=embed.weight.device) if own else embed
            self.model.mtp_embed_tokens = copy
            self.model.mtp_shares_head = self.cfg.tie_word_embeddings and not own
        if not first:
            self.model.embed_tokens = None
        if not last:
            self.model.mtp = None
            self.model.norm = None
            self.lm_head = None
        return self
