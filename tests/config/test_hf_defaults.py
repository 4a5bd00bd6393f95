"""Issue 43 item 11: a config.json that leaves out an optional key reads as the family's transformers
config class reads it (Qwen3 without head_dim: 128, not hidden/heads). Config alone decides, so no weights."""

from __future__ import annotations

import pytest
import transformers

from dtensor3d.config.hf_config import (
    DEEPSEEK_MOE_DEFAULTS,
    FAMILY_DEFAULTS,
    GLM4_MOE_DEFAULTS,
    GLM4_MOE_SIZES,
    GPT_OSS_DEFAULTS,
    GPT_OSS_ROPE,
    MIXTRAL_DEFAULTS,
    MLA_DEFAULTS,
    QWEN3_MOE_DEFAULTS,
    family_defaults,
    hf_model_values,
)

BASE = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 80,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5 / 3,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
    "rope_theta": 5e5,
}
EXTRA = {
    "mistral": {"sliding_window": 64},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 1, "router_aux_loss_coef": 0.02},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02}
    | {"moe_intermediate_size": 24, "norm_topk_prob": True},
    "deepseek_v3": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 2, "n_group": 2}
    | {"topk_group": 1, "routed_scaling_factor": 1.5, "norm_topk_prob": False, "moe_intermediate_size": 24}
    | {"first_k_dense_replace": 1, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8}
    | {"qk_rope_head_dim": 4, "v_head_dim": 8},
}
MOE_TABLES = {
    "mixtral": MIXTRAL_DEFAULTS,
    "qwen3_moe": QWEN3_MOE_DEFAULTS,
    "deepseek_v3": MLA_DEFAULTS | DEEPSEEK_MOE_DEFAULTS,
    "glm4_moe": DEEPSEEK_MOE_DEFAULTS | GLM4_MOE_DEFAULTS | GLM4_MOE_SIZES,
    "gpt_oss": GPT_OSS_DEFAULTS,
}
EXPERTS = {"mixtral": "num_local_experts", "gpt_oss": "num_local_experts", "qwen3_moe": "num_experts"} | dict.fromkeys(
    ("deepseek_v3", "glm4_moe"), "n_routed_experts"
)
MOE_FIELDS = (
    *("num_experts_per_tok", "router_aux_loss_coef", "moe_intermediate_size", "norm_topk_prob"),
    *("n_shared_experts", "n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace"),
    *("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
)
FIELDS = (*BASE, "sliding_window", "num_local_experts", *MOE_FIELDS)


def _tiny(kind: str) -> dict:
    hf = {"model_type": kind, **BASE, **EXTRA.get(kind, {})}
    if kind == "deepseek_v3":  # MLA: every head has its own key and value; head_dim is qk_rope_head_dim
        del hf["head_dim"], hf["num_key_value_heads"]
    return hf


def _rope_theta(cfg) -> float:
    """The full-attention layers' theta (per layer type in OLMo 3 and Gemma 3: the sliding layers'
    own is model.sliding_rope)."""
    rope = cfg.rope_parameters
    return rope["full_attention"]["rope_theta"] if "full_attention" in rope else rope["rope_theta"]


def _theirs(hf: dict) -> dict:
    """The model transformers' config class reads from `hf`, in our field names."""
    kind = hf["model_type"]
    cfg = transformers.CONFIG_MAPPING[kind](**hf)
    out = {key: getattr(cfg, key, None) for key in FIELDS}
    out["head_dim"] = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if kind == "deepseek_v3":  # its attention reads neither head_dim nor num_key_value_heads
        out["head_dim"], cfg.num_key_value_heads = cfg.qk_rope_head_dim, cfg.num_attention_heads
    out["rope_theta"] = _rope_theta(cfg)
    out["num_key_value_heads"] = cfg.num_key_value_heads or cfg.num_attention_heads
    out["num_local_experts"] = getattr(cfg, EXPERTS[kind]) if kind in EXPERTS else None
    if kind in ("qwen2", "qwen3", "qwen3_moe") and not getattr(cfg, "use_sliding_window", False):
        out["sliding_window"] = None
    return out


def _ours(hf: dict) -> dict:
    values = hf_model_values(hf, "config.json")
    out = {key: values.get(key) for key in FIELDS}
    out["head_dim"] = values["head_dim"] or values["hidden_size"] // values["num_attention_heads"]
    return out


CASES = [(kind, key) for kind in FAMILY_DEFAULTS for key in [None, *_tiny(kind)] if key != "model_type"]


@pytest.mark.parametrize(("kind", "key"), CASES, ids=[f"{k}-{key or 'full'}" for k, key in CASES])
def test_absent_key_takes_the_family_default(kind, key):
    hf = _tiny(kind)
    hf.pop(key, None)
    theirs, ours = _theirs(hf), _ours(hf)
    assert {k: v for k, v in ours.items() if k in theirs and theirs[k] is not None} == {
        k: v for k, v in theirs.items() if v is not None
    }, f"{kind} without {key}"


@pytest.mark.parametrize("kind", list(FAMILY_DEFAULTS))
def test_defaults_table_matches_transformers(kind):
    cfg = transformers.CONFIG_MAPPING[kind]()
    for key, value in (family_defaults(kind) | MOE_TABLES.get(kind, {})).items():
        if key == "rope_theta":
            assert _rope_theta(cfg) == value, kind
        elif key == "head_dim" and kind == "deepseek_v3":  # MLA's head_dim is qk_rope_head_dim (MLA_DEFAULTS)
            assert cfg.head_dim == MLA_DEFAULTS["qk_rope_head_dim"]
        elif key == "head_dim" and value is None:
            assert getattr(cfg, key, None) in (None, cfg.hidden_size // cfg.num_attention_heads), kind
        elif key == "num_key_value_heads" and value is None:
            assert cfg.num_key_value_heads == cfg.num_attention_heads, kind
        elif hasattr(cfg, key):
            assert getattr(cfg, key) == value, f"{kind}.{key}: transformers {getattr(cfg, key)!r}, ours {value!r}"


def test_gpt_oss_rope_default_is_its_yarn():
    """A gpt-oss config.json without rope_parameters reads as GptOssConfig's YaRN (factor 32, truncate off)."""
    cfg = transformers.GptOssConfig()
    theirs = {k: v for k, v in cfg.rope_parameters.items() if k != "rope_theta"}
    assert theirs == GPT_OSS_ROPE
    values = hf_model_values({"model_type": "gpt_oss"}, "config.json")
    assert values["rope_scaling"] == GPT_OSS_ROPE and values["rope_theta"] == cfg.rope_parameters["rope_theta"]
    assert values["attention_bias"] and values["layer_types"][:2] == ["sliding_attention", "full_attention"]
