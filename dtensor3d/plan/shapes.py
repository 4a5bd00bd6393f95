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


def _layer_shapes(cfg, index: int) -> dict[str, tuple[int, ...]]:
    """One decoder layer's parameters (models/llama.py DecoderLayer), by name within the layer."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    out: dict[str, tuple[int, ...]] = {"input_layernorm.weight": (h,)}
    for name, shape in (("q_proj", (q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h))):
        out[f"self_attn.{name}.weight"] = shape
        if cfg.qkv_bias:
            out[f"self_attn.{name}.bias"] = shape[:1]
    out["self_attn.o_proj.weight"] = (h, q)
    if cfg.attention_bias:
        out["self_attn.o_proj.bias"] = (h,)
    if cfg.qk_norm:
        out |= {"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
    out["post_attention_layernorm.weight"] = (h,)
    if not cfg.is_moe_layer(index):
        return out | _mlp_shapes("mlp", h, cfg.intermediate_size, cfg.mlp_bias)
    e, inter = cfg.num_local_experts, cfg.expert_intermediate_size
    out["block_sparse_moe.gate.weight"] = (e, h)
    if cfg.correction_bias:
        out["block_sparse_moe.gate.e_score_correction_bias"] = (e,)
    out |= {
        "block_sparse_moe.experts.w1": (e, h, inter),
        "block_sparse_moe.experts.w2": (e, inter, h),
        "block_sparse_moe.experts.w3": (e, h, inter),
    }
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
    out = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    for i in range(cfg.num_hidden_layers):
        out |= {f"model.layers.{i}.{name}": shape for name, shape in _layer_shapes(cfg, i).items()}
    out["model.norm.weight"] = (cfg.hidden_size,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return out


def layer_of(name: str) -> int | None:
    """The global decoder layer index of a parameter name (None: embedding, final norm, head)."""
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") else None


# The dim tp splits each weight on, by name within the model or within a decoder layer
# (parallel/tensor.py's tp_plan: the embedding is Rowwise on the vocabulary, the head and
# q/k/v/gate/up Colwise, o/down Rowwise). Everything else (norms, the router, experts, a
# shared expert, a row-parallel bias, a per-head q/k norm) is whole on every tp rank; a
# column-parallel bias is split like its rows.
TP_OUTER = {"model.embed_tokens.weight": 0, "lm_head.weight": 0}
TP_LAYER = {
    "self_attn.q_proj.weight": 0,
    "self_attn.k_proj.weight": 0,
    "self_attn.v_proj.weight": 0,
    "self_attn.o_proj.weight": 1,
    "mlp.gate_proj.weight": 0,
    "mlp.up_proj.weight": 0,
    "mlp.down_proj.weight": 1,
    "self_attn.q_proj.bias": 0,
    "self_attn.k_proj.bias": 0,
    "self_attn.v_proj.bias": 0,
    "mlp.gate_proj.bias": 0,
    "mlp.up_proj.bias": 0,
}


def tp_dim(name: str) -> int | None:
    """The dim tensor parallelism splits parameter `name` on (None: replicated over tp)."""
    if layer_of(name) is None:
        return TP_OUTER.get(name)
    return TP_LAYER.get(name.split(".", 3)[3])


def flops_per_token(cfg, seq_len: int) -> float:
    """Training FLOPs per token: 6 * non-embedding params + attention (PaLM's estimate)."""
    h, L = cfg.hidden_size, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    ffn = 3 * h * cfg.intermediate_size + (2 * cfg.intermediate_size + h) * cfg.mlp_bias
    if cfg.num_local_experts:  # MoE layers: top-k experts, the router and any shared expert per token
        expert = 3 * h * cfg.expert_intermediate_size + (2 * cfg.expert_intermediate_size + h) * cfg.mlp_bias
        moe = expert * cfg.num_experts_per_tok + h * cfg.num_local_experts + 3 * h * cfg.shared_intermediate_size
        n_moe = sum(cfg.is_moe_layer(i) for i in range(L))
        ffn_total = n_moe * moe + (L - n_moe) * ffn
    else:
        ffn_total = L * ffn
    biases = (q + 2 * kv) * cfg.qkv_bias + h * cfg.attention_bias
    dense = L * (h * q * 2 + h * kv * 2 + biases) + ffn_total + h * cfg.vocab_size  # the head counts, the lookup not
    return 6 * dense + 12 * L * q * seq_len
