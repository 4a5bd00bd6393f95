"""The model's arithmetic without torch: every parameter's name and shape, the dim tensor
parallelism splits it on, and the FLOPs of a token. `plan` (dtensor3d/estimate.py) runs
before anything starts and must not import torch, so these are pure functions of the
ModelConfig.

`param_shapes` is the table `models.build_on_meta(cfg).named_parameters()` yields, name
for name and in the same order (tests/plan/test_plan_simulate.py checks it); `tp_dim` reads
parallel/tensor.py's plan (Colwise: a Linear's dim 0; Rowwise: a Linear's dim 1 and an
Embedding's dim 0), checked against that plan by the same tests.
"""

from __future__ import annotations

import math


def _attention_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Grouped-query attention's parameters (models/llama.py Attention), by name within it."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in (("q_proj", (q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h))):
        out[f"{name}.weight"] = shape
        if cfg.qkv_bias:
            out[f"{name}.bias"] = shape[:1]
    out["o_proj.weight"] = (h, q)
    if cfg.o_bias:
        out["o_proj.bias"] = (h,)
    if cfg.qk_norm:
        out |= {"q_norm.weight": (q,), "k_norm.weight": (kv,)} if cfg.qk_norm_whole else {}
        out |= {} if cfg.qk_norm_whole else {"q_norm.weight": (hd,), "k_norm.weight": (hd,)}
    return ({"sinks": (cfg.num_attention_heads,)} if cfg.sinks else {}) | out  # its own parameter first


def _mla_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Multi-head latent attention's parameters (models/mla.py), by name within it."""
    h, heads, bias = cfg.hidden_size, cfg.num_attention_heads, cfg.attention_bias
    qk, latent = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.kv_lora_rank
    out: dict[str, tuple[int, ...]] = {}
    if cfg.q_lora_rank is None:
        out["q_proj.weight"] = (heads * qk, h)
    else:
        out["q_a_proj.weight"] = (cfg.q_lora_rank, h)
        out |= {"q_a_proj.bias": (cfg.q_lora_rank,)} if bias else {}
        out["q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        out["q_b_proj.weight"] = (heads * qk, cfg.q_lora_rank)
    out["kv_a_proj_with_mqa.weight"] = (latent + cfg.qk_rope_head_dim, h)
    out |= {"kv_a_proj_with_mqa.bias": (latent + cfg.qk_rope_head_dim,)} if bias else {}
    out["kv_a_layernorm.weight"] = (latent,)
    out["kv_b_proj.weight"] = (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), latent)
    out["o_proj.weight"] = (h, heads * cfg.v_head_dim)
    return out | ({"o_proj.bias": (h,)} if bias else {})


def _layer_shapes(cfg, index: int) -> dict[str, tuple[int, ...]]:
    """One decoder layer's parameters (models/llama.py DecoderLayer), by name within the layer."""
    h = cfg.hidden_size
    out: dict[str, tuple[int, ...]] = {} if cfg.post_norms else {"input_layernorm.weight": (h,)}
    attention = _mla_shapes(cfg) if cfg.mla else _attention_shapes(cfg)
    out |= {f"self_attn.{name}": shape for name, shape in attention.items()}
    out["post_attention_layernorm.weight"] = (h,)
    out |= {"pre_feedforward_layernorm.weight": (h,)} if cfg.sandwich_norms else {}
    out |= {"post_feedforward_layernorm.weight": (h,)} if cfg.post_norms or cfg.sandwich_norms else {}
    if not cfg.is_moe_layer(index):
        return out | _mlp_shapes("mlp", h, cfg.intermediate_size, cfg.mlp_bias)
    e, inter = cfg.num_local_experts, cfg.expert_intermediate_size
    out["block_sparse_moe.gate.weight"] = (e, h)
    out |= {"block_sparse_moe.gate.bias": (e,)} if cfg.expert_bias else {}
    if cfg.correction_bias:
        out["block_sparse_moe.gate.e_score_correction_bias"] = (e,)
    out |= {
        "block_sparse_moe.experts.w1": (e, h, inter),
        "block_sparse_moe.experts.w2": (e, inter, h),
        "block_sparse_moe.experts.w3": (e, h, inter),
    }
    if cfg.expert_bias:  # gpt-oss
        out |= {f"block_sparse_moe.experts.w{i}_bias": (e, h if i == 2 else inter) for i in (1, 2, 3)}
    if cfg.shared_intermediate_size:
        out |= _mlp_shapes("block_sparse_moe.shared_expert", h, cfg.shared_intermediate_size, cfg.mlp_bias)
    return out


def _mlp_shapes(prefix: str, h: int, inter: int, bias: bool) -> dict[str, tuple[int, ...]]:
    out = {}
    for n, shape in zip(("gate_proj", "up_proj", "down_proj"), [(inter, h), (inter, h), (h, inter)]):
        out[f"{prefix}.{n}.weight"] = shape
        if bias:
            out[f"{prefix}.{n}.bias"] = shape[:1]
    return out


def param_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """name -> shape of every parameter of the whole single-device model, in
    `named_parameters()` order (a tied head is the embedding, listed once)."""
    out = {"model.embed_tokens.weight": (cfg.padded_vocab_size, cfg.hidden_size)}
    for i in range(cfg.num_hidden_layers):
        out |= {f"model.layers.{i}.{name}": shape for name, shape in _layer_shapes(cfg, i).items()}
    out["model.norm.weight"] = (cfg.hidden_size,)
    out |= _mtp_shapes(cfg)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.padded_vocab_size, cfg.hidden_size)
    return out


def _mtp_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """The MTP modules' parameters (models/mtp.py): model.mtp.{N+k-1}, each a decoder layer of
    index N+k-1 with enorm, hnorm, eh_proj [hidden, 2 hidden] and shared_head.norm after its own
    (the embedding and the head are the main model's, not counted again)."""
    h, n, out = cfg.hidden_size, cfg.num_hidden_layers, {}
    extra = {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h), "shared_head.norm.weight": (h,)}
    for i in range(n, n + cfg.num_nextn_predict_layers):
        out |= {f"model.mtp.{i}.{name}": shape for name, shape in (_layer_shapes(cfg, i) | extra).items()}
    return out


def mtp_copies(cfg) -> int:
    """Parameters a DeepSeek-V3 checkpoint holds beyond the model's: each MTP layer's copies of
    the embedding and the head (model.layers.{N+k-1}.embed_tokens / shared_head.head), which
    dtensor3d shares with the main model (checkpoint/hf_names.py writes them on export)."""
    return 2 * cfg.num_nextn_predict_layers * cfg.padded_vocab_size * cfg.hidden_size


def weight_groups(cfg, index: int) -> int:
    """The parameter groups of decoder layer `index` whose gradient reads a tensor its forward
    saved (torch.distributed.pipelining's split backward computes one group per autograd.grad,
    pipelining/_backward.py: each weight meets the activations at its own op): every
    parameter tensor but the biases (a bias's gradient sums the output's, reading nothing
    saved) and the router's correction bias (no gradient)."""
    names = _layer_shapes(cfg, index)
    return sum(1 for name in names if not name.endswith("bias"))


def layer_of(name: str) -> int | None:
    """The global decoder layer index of a parameter name (None: embedding, final norm, head);
    an MTP module's (model.mtp.{N+k-1}): N+k-1, past the last decoder layer."""
    parts = name.split(".")
    return int(parts[2]) if name.startswith(("model.layers.", "model.mtp.")) else None


# The dim tp splits each weight on, by name within the model or within a decoder layer
# (parallel/tensor.py's tp_plan: the embedding is Rowwise on the vocabulary, the head and
# q/k/v/gate/up Colwise, o/down Rowwise). Everything else (norms, the router, experts, a
# shared expert, a row-parallel bias, a per-head q/k norm) is whole on every tp rank; a
# column-parallel bias is split like its rows.
TP_OUTER = {"model.embed_tokens.weight": 0, "lm_head.weight": 0, "model.mtp_embed_tokens.weight": 0}
TP_LAYER = {
    "self_attn.q_proj.weight": 0,
    "self_attn.k_proj.weight": 0,
    "self_attn.v_proj.weight": 0,
    "self_attn.o_proj.weight": 1,
    "self_attn.q_b_proj.weight": 0,  # multi-head latent attention: the per-head up projections
    "self_attn.kv_b_proj.weight": 0,
    "mlp.gate_proj.weight": 0,
    "mlp.up_proj.weight": 0,
    "mlp.down_proj.weight": 1,
    "self_attn.q_proj.bias": 0,
    "self_attn.k_proj.bias": 0,
    "self_attn.v_proj.bias": 0,
    "mlp.gate_proj.bias": 0,
    "mlp.up_proj.bias": 0,
    "self_attn.sinks": 0,  # gpt-oss: per head (ShardParameter)
}


TP_WHOLE_NORM = {"self_attn.q_norm.weight": 0, "self_attn.k_norm.weight": 0}  # over the whole projection (OLMo 2)


def tp_dim(name: str, cfg=None) -> int | None:
    """The dim tensor parallelism splits parameter `name` on (None: replicated over tp); `cfg`:
    the model's config, for q/k norms over the whole projection (split like its columns)."""
    if layer_of(name) is None:
        return TP_OUTER.get(name)
    within = name.split(".", 3)[3]
    if cfg is not None and cfg.qk_norm_whole and within in TP_WHOLE_NORM:
        return TP_WHOLE_NORM[within]
    return TP_LAYER.get(within)


def attended_keys(cfg, seq_len: int) -> int:
    """Keys a token's queries score, summed over the layers, as PaLM's estimate counts them: the
    whole sequence in a full-attention layer, the window in a sliding-window one (a query sees its
    last `window` positions only)."""
    return sum(min(cfg.layer_window(i) or seq_len, seq_len) for i in range(cfg.num_hidden_layers))


def flops_per_token(cfg, seq_len: int) -> float:
    """Training FLOPs per token: 6 * non-embedding params + attention (PaLM's estimate; a
    sliding-window layer's attention over its window, `attended_keys`). Each MTP module
    (models/mtp.py) counts as one more layer plus its eh_proj and another pass of the head."""
    h, D = cfg.hidden_size, cfg.num_nextn_predict_layers
    L = cfg.num_hidden_layers + D  # the MTP blocks are layers N..N+D-1 (their own attention and feed-forward)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    ffn = 3 * h * cfg.intermediate_size + (2 * cfg.intermediate_size + h) * cfg.mlp_bias
    if cfg.num_local_experts:  # MoE layers: top-k experts, the router and any shared expert per token
        expert = 3 * h * cfg.expert_intermediate_size + (2 * cfg.expert_intermediate_size + h) * cfg.mlp_bias
        moe = expert * cfg.num_experts_per_tok + h * cfg.num_local_experts + 3 * h * cfg.shared_intermediate_size
        n_moe = sum(cfg.is_moe_layer(i) for i in range(L))
        ffn_total = n_moe * moe + (L - n_moe) * ffn
    else:
        ffn_total = L * ffn
    biases = (q + 2 * kv) * cfg.qkv_bias + h * (cfg.o_bias if not cfg.mla else cfg.attention_bias)
    attention, scores = h * q * 2 + h * kv * 2 + biases, 2 * q  # per layer: projections; q.k and p.v widths
    if cfg.mla:  # the projections' matrices and biases (norms excluded, as above); q.k over qk, p.v over v
        attention = sum(math.prod(s) for n, s in _mla_shapes(cfg).items() if "norm" not in n)
        scores = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    dense = L * attention + ffn_total + h * cfg.padded_vocab_size  # the head counts (its padding too), the lookup not
    dense += D * (2 * h * h + h * cfg.padded_vocab_size)  # MTP: eh_proj and the shared head again
    mtp_keys = sum(min(cfg.layer_window(i) or seq_len, seq_len) for i in range(cfg.num_hidden_layers, L))
    return 6 * dense + 6 * scores * (attended_keys(cfg, seq_len) + mtp_keys)
