"""config.json for a model we export: Llama's common keys, the family's own (config/families.py),
and a refusal naming the setting a family's transformers class cannot hold."""

from __future__ import annotations

from ..config.families import FAMILIES
from ..errors import CheckpointError
from .hf_names import DEEPSEEK_MOE_KEYS, LLAMA_KEYS, MIXTRAL_DEFAULTS, MLA_DEFAULTS, QWEN3_MOE_KEYS

# The fields of a config.json that are fixed for every model we write.
_COMMON = {"hidden_act": "silu", "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True}


_TOKEN_DEFAULTS = {
    "smollm3": {"pad_token_id": 128004, "bos_token_id": 128000, "eos_token_id": 128001},
    "phi3": {"pad_token_id": 32000, "bos_token_id": 1, "eos_token_id": 32000},
}


def _family_fields(cfg, name: str) -> dict:
    """What the family's own config class holds beyond Llama's common keys."""
    family, layers = FAMILIES[name], cfg.num_hidden_layers
    out = {key: getattr(cfg, key) for key in family.biases}
    if family.window_switch:
        types = [("full_attention" if cfg.layer_window(i) is None else "sliding_attention") for i in range(layers)]
        first = types.index("sliding_attention") if cfg.sliding_window is not None else layers
        out.update(use_sliding_window=first < layers, sliding_window=cfg.sliding_window, max_window_layers=first)
        out["layer_types"] = types
    elif name in ("mistral", "mixtral", "phi3"):  # one window on every layer
        if len({cfg.layer_window(i) for i in range(layers)}) > 1:
            raise CheckpointError(
                f"model.layer_types={list(cfg.layer_types)}: {family.architecture} windows every layer alike; "
                "export a model whose layer_types is null"
            )
        out["sliding_window"] = cfg.sliding_window
    if family.sandwich_norms:  # Gemma 3: its activation's key and the attention scale
        out.update(hidden_activation=cfg.hidden_act, hidden_act=cfg.hidden_act)
        out.update(query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.head_dim)
        out.update(final_logit_softcapping=None, attn_logit_softcapping=None)
    if family.layer_rope or family.types_key:  # OLMo 3, Gemma 3, gpt-oss: the window on the sliding layers
        out["sliding_window"] = cfg.sliding_window
        out["layer_types"] = [
            ("full_attention" if cfg.layer_window(i) is None else "sliding_attention") for i in range(layers)
        ]
    if family.nope:  # SmolLM3
        out["no_rope_layers"] = [int(cfg.layer_rope(i)) for i in range(layers)]
    # the class's special-token defaults where the vocabulary holds them (else its embedding refuses)
    tokens = _TOKEN_DEFAULTS.get(name, {})
    out.update({key: (t if t < cfg.vocab_size else None) for key, t in tokens.items()})
    return out | _moe_fields(cfg, name)


def _moe_fields(cfg, name: str) -> dict:
    """The expert and router keys of a mixture-of-experts family's config class."""
    out = {}
    if name == "gpt_oss":  # Mixtral's keys, and its clamped SwiGLU's
        out.update({key: getattr(cfg, key) for key in MIXTRAL_DEFAULTS}, output_router_logits=False)
        out.update(swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha)
    if name == "mixtral":
        out.update({key: getattr(cfg, key) for key in MIXTRAL_DEFAULTS})
        out.update(router_jitter_noise=0.0, output_router_logits=False)
    if name == "qwen3_moe":
        out.update({key: getattr(cfg, key) for key in QWEN3_MOE_KEYS})
        out.update(num_experts=cfg.num_local_experts, mlp_only_layers=list(cfg.mlp_only_layers or ()))
        out.update(moe_intermediate_size=cfg.expert_intermediate_size, output_router_logits=False)
    if name == "glm4_moe":  # DeepSeek-V3's routing keys; its MTP layers laid out as DeepSeek-V3's (vLLM's glm4_moe_mtp)
        out.update({key: getattr(cfg, key) for key in DEEPSEEK_MOE_KEYS}, use_qk_norm=cfg.use_qk_norm)
        out.update(n_routed_experts=cfg.num_local_experts, moe_intermediate_size=cfg.expert_intermediate_size)
        out.update(first_k_dense_replace=_dense_layers(cfg), output_router_logits=False)
        out["num_nextn_predict_layers"] = out["num_mtp_layers"] = cfg.num_nextn_predict_layers
    if name == "deepseek_v3":  # its MTP layers under model.layers.{N+k-1} (transformers ignores them)
        out.update({key: getattr(cfg, key) for key in (*MLA_DEFAULTS, *DEEPSEEK_MOE_KEYS)})
        out.update(n_routed_experts=cfg.num_local_experts, moe_intermediate_size=cfg.expert_intermediate_size)
        out.update(first_k_dense_replace=_dense_layers(cfg), output_router_logits=False)
        out["num_nextn_predict_layers"] = cfg.num_nextn_predict_layers
    return out


# What each exported MoE family's transformers class cannot hold: (setting, value it must have).
_NO_DEEPSEEK = {
    "shared_expert_intermediate_size": 0,
    "n_shared_experts": 0,
    "moe_layers": None,
    "scoring_func": "softmax",
    "n_group": 1,
    "routed_scaling_factor": 1.0,
    "router_bias_update_rate": 0.0,  # balancing gives the router a correction bias
    "first_k_dense_replace": 0,
}
# DeepSeek-V3's routing, which GLM-4.5's class shares: sigmoid scores with a correction bias.
_DEEPSEEK_ROUTING = {
    "shared_expert_intermediate_size": 0,
    "moe_layers": None,
    "scoring_func": "sigmoid",
    "correction_bias": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": None,
}
_MOE_FIXED = {
    "mixtral": {
        **_NO_DEEPSEEK,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": None,
        "moe_intermediate_size": 0,
    },
    "qwen3_moe": _NO_DEEPSEEK,
    "glm4_moe": _DEEPSEEK_ROUTING,
    # gpt-oss: softmax over the top-k logits (the top k renormalised), its clamped SwiGLU, one expert width
    "gpt_oss": {**_NO_DEEPSEEK, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": None}
    | {"moe_intermediate_size": 0, "num_local_experts": "> 0", "swiglu_limit": "a number"},
    "deepseek_v3": _DEEPSEEK_ROUTING,
}


def _dense_layers(cfg) -> int:
    """DeepSeek-V3's first_k_dense_replace: every layer when the model has no experts."""
    return cfg.first_k_dense_replace if cfg.num_local_experts else cfg.num_hidden_layers


def _refuse_export(cfg, name: str) -> None:
    """One line when the model has a switch the family's transformers class lacks."""
    for key, value in _MOE_FIXED.get(name, {}).items():
        have = getattr(cfg, key)
        if value == "> 0" or value == "a number":  # gpt-oss: experts always, clamped always
            bad = not have if value == "> 0" else have is None
        else:
            bad = have != value and not (key == "mlp_only_layers" and not have)
        if bad:
            raise CheckpointError(
                f"model.{key}={have!r}: transformers' {FAMILIES[name].architecture} has no such setting "
                f"(it needs {value!r}); this model does not export to Hugging Face as {name}"
            )


def hf_config(cfg) -> dict:
    """config.json for transformers' model class of the family (Mixtral's for a llama with experts)."""
    name = cfg.family if FAMILIES[cfg.family].experts or not cfg.num_local_experts else "mixtral"
    if cfg.num_local_experts or name == "gpt_oss":
        _refuse_export(cfg, name)
    if cfg.swiglu_limit is not None and name != "gpt_oss":
        raise CheckpointError(
            f"model.swiglu_limit={cfg.swiglu_limit}: transformers' {FAMILIES[name].architecture} has no clamped "
            f"SwiGLU (gpt_oss has); this model does not export to Hugging Face as {name}"
        )
    rope = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    rope |= {"partial_rotary_factor": cfg.partial_rotary_factor} if cfg.partial_rotary_factor != 1.0 else {}
    layer_rope = FAMILIES[name].layer_rope
    return {
        "architectures": [FAMILIES[name].architecture],
        "model_type": FAMILIES[name].model_type,
        **{key: getattr(cfg, key) for key in LLAMA_KEYS},
        "vocab_size": cfg.padded_vocab_size,  # the embedding's rows, padding included (as Megatron and nanotron)
        "head_dim": cfg.head_dim,
        **_COMMON,
        "hidden_act": cfg.hidden_act,
        **_family_fields(cfg, name),
        "rope_parameters": {"full_attention": rope, "sliding_attention": cfg.sliding_rope or rope}
        if layer_rope
        else rope,
        "torch_dtype": "float32",
    }
