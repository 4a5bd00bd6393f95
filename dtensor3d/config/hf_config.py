"""Hugging Face config.json -> the recipe's `model` fields, without torch: the one reader that
import-hf, init_from_hf and a recipe whose `model` section is left to `checkpoint.init_from_hf`
share (config/load.py reads it before any process starts)."""

from __future__ import annotations

import json
import os

from ..errors import CheckpointError
from .families import ACTIVATIONS, BY_MODEL_TYPE, FAMILIES, rope_problem

# Hugging Face LlamaConfig's defaults, for keys a config.json leaves out.
HF_DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
# Each family's transformers config class where its defaults differ from LlamaConfig's (for the
# keys read here; tests/config/test_hf_defaults.py checks this table against transformers). Besides
# HF_DEFAULTS' keys: num_key_value_heads (None: num_attention_heads), head_dim (None: hidden_size //
# num_attention_heads), rope_theta, and sliding_window / max_window_layers where the class has them.
_QWEN2 = {"vocab_size": 151936, "intermediate_size": 22016, "max_position_embeddings": 32768, "num_key_value_heads": 32}
_MISTRAL = {"intermediate_size": 14336, "max_position_embeddings": 131072, "num_key_value_heads": 8}
FAMILY_DEFAULTS = {
    "llama": {},
    "qwen2": _QWEN2 | {"max_window_layers": 28},
    "qwen3": _QWEN2 | {"max_window_layers": 28, "head_dim": 128},
    "mistral": _MISTRAL | {"sliding_window": 4096},
    "mixtral": _MISTRAL | {"rms_norm_eps": 1e-5, "rope_theta": 1e6},
    "qwen3_moe": _QWEN2
    | {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24, "num_key_value_heads": 4},
    "deepseek_v3": {"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61}
    | {"num_attention_heads": 128, "num_key_value_heads": 128, "max_position_embeddings": 4096},
    "olmo2": {"vocab_size": 50304, "rms_norm_eps": 1e-5},
    "olmo3": {"vocab_size": 50304, "rms_norm_eps": 1e-5, "sliding_window": 4096, "rope_theta": 5e5},
    "smollm3": {"vocab_size": 128256, "hidden_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 16}
    | {"num_key_value_heads": 4, "max_position_embeddings": 32768, "tie_word_embeddings": True, "rope_theta": 2e6},
    "gemma3_text": {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26}
    | {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072}
    | {"tie_word_embeddings": True, "sliding_window": 4096, "rope_theta": 1e6},
    "phi3": {"vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192, "rms_norm_eps": 1e-5}
    | {"max_position_embeddings": 4096},
    "glm4_moe": {"vocab_size": 151552, "intermediate_size": 10944, "num_hidden_layers": 46, "num_attention_heads": 96}
    | {"num_key_value_heads": 8, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072},
    "gpt_oss": {"vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36}
    | {"num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072}
    | {"rms_norm_eps": 1e-5, "sliding_window": 128, "rope_theta": 150000.0},
}
# GptOssConfig's: its expert and router keys (softmax over the top-k logits: softmax, then the top k
# renormalised), attention biases on, and its YaRN scaling when config.json gives none.
GPT_OSS_DEFAULTS = {"num_local_experts": 128, "num_experts_per_tok": 4, "router_aux_loss_coef": 0.001}
GPT_OSS_DEFAULTS |= {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
GPT_OSS_ROPE |= {"original_max_position_embeddings": 4096}


def family_defaults(kind: str) -> dict:
    """The config.json defaults of model_type `kind` (LlamaConfig's for a family not in the table)."""
    base = HF_DEFAULTS | {"num_key_value_heads": None, "head_dim": None, "rope_theta": 10000.0}
    return base | {"sliding_window": None, "max_window_layers": 28} | FAMILY_DEFAULTS.get(kind, {})


# ModelConfig fields that a Llama config.json holds under the same name.
LLAMA_KEYS = (*HF_DEFAULTS, "num_key_value_heads", "rope_theta")
# ...and the ones a Mixtral config.json adds (with MixtralConfig's defaults).
MIXTRAL_DEFAULTS = {"num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001}
# ...and DeepseekV3Config's multi-head latent attention keys (with its defaults).
MLA_DEFAULTS = {
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rope_interleave": True,
}
# ...and a Qwen3-MoE config.json's (Qwen3MoeConfig's defaults; it spells the expert count num_experts).
QWEN3_MOE_DEFAULTS = {
    "num_experts_per_tok": 8,
    "router_aux_loss_coef": 0.001,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 768,
}
QWEN3_MOE_KEYS = tuple(QWEN3_MOE_DEFAULTS)
# ...and DeepSeek-V3's router keys (DeepseekV3Config's defaults; its expert count is n_routed_experts).
DEEPSEEK_MOE_DEFAULTS = {
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
}
DEEPSEEK_MOE_KEYS = tuple(DEEPSEEK_MOE_DEFAULTS)
# The same router keys in a GLM-4.5 config.json, with Glm4MoeConfig's defaults (and its sizes).
GLM4_MOE_DEFAULTS = {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0}
GLM4_MOE_SIZES = {"n_routed_experts": 128, "moe_intermediate_size": 1408, "first_k_dense_replace": 1}
DEEPSEEK_MOE_SIZES = {"n_routed_experts": 256, "moe_intermediate_size": 2048, "first_k_dense_replace": 3}


def _moe_values(hf: dict, kind: str) -> dict:
    """The mixture-of-experts fields of a Mixtral, Qwen3-MoE or DeepSeek-V3 config.json."""
    if kind == "mixtral":
        return {key: hf.get(key, default) for key, default in MIXTRAL_DEFAULTS.items()}
    if kind == "gpt_oss":
        return {key: hf.get(key, default) for key, default in GPT_OSS_DEFAULTS.items()} | {"norm_topk_prob": True}
    if kind in ("deepseek_v3", "glm4_moe"):  # sigmoid scores with the correction bias; no aux loss in transformers
        glm = kind == "glm4_moe"
        defaults = DEEPSEEK_MOE_DEFAULTS | (GLM4_MOE_DEFAULTS if glm else {})
        sizes = {key: hf.get(key, d) for key, d in (GLM4_MOE_SIZES if glm else DEEPSEEK_MOE_SIZES).items()}
        values = {key: hf.get(key, default) for key, default in defaults.items()}
        values.update(num_local_experts=sizes["n_routed_experts"], scoring_func="sigmoid", router_aux_loss_coef=0.0)
        values.update(moe_intermediate_size=sizes["moe_intermediate_size"])
        values["first_k_dense_replace"] = sizes["first_k_dense_replace"]
        return values | {"n_group": values["n_group"] or 1, "topk_group": values["topk_group"] or 1}
    values = {key: hf.get(key, default) for key, default in QWEN3_MOE_DEFAULTS.items()}
    values["num_local_experts"] = hf.get("num_experts", hf.get("num_local_experts", 128))
    values["mlp_only_layers"] = list(hf.get("mlp_only_layers") or ()) or None
    return values


def _refuse_unsupported(hf: dict, kind: str, where: str) -> None:
    """Refuse what these families cannot run, naming the config key."""

    def refuse(key: str, why: str) -> CheckpointError:
        return CheckpointError(f"{where}: {key}={hf.get(key)!r}: {why}")

    if kind not in BY_MODEL_TYPE:
        raise refuse("model_type", f"supported model_type: {', '.join(BY_MODEL_TYPE)}")
    if kind in ("mixtral", "qwen3_moe") and hf.get("router_jitter_noise", 0.0):
        raise refuse("router_jitter_noise", "router noise is not supported; use 0.0")
    act = "hidden_activation" if "hidden_activation" in hf else "hidden_act"  # Gemma's key, or Llama's
    if hf.get(act, "silu") not in ACTIVATIONS:
        raise refuse(act, f"supported: {', '.join(ACTIVATIONS)} (SwiGLU, GeGLU)")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise refuse(key, "logit soft-capping is not supported; use null")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key) and key not in FAMILIES[BY_MODEL_TYPE[kind]].biases:
            raise refuse(key, f"not supported for model_type {kind!r}")
    if hf.get("attention_dropout", 0.0):
        raise refuse("attention_dropout", "dropout is not supported; use 0.0")


def _rope_from_hf(hf: dict, where: str, default_theta: float) -> tuple[float, dict | None, dict | None]:
    """(rope_theta, rope_scaling, sliding_rope) from transformers 5's rope_parameters (per
    layer type: OLMo 3's) or 4's rope_theta and rope_scaling; the default RoPE is no scaling."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"  # a 4.x scaling wins
    if hf.get("model_type") == "gpt_oss" and not hf.get(key):
        hf = hf | {key: GPT_OSS_ROPE}
    theta = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", default_theta))
    params = dict(hf.get(key) or {})
    if "full_attention" not in params:
        local = hf.get("rope_local_base_freq")  # Gemma 3's sliding-layer base in transformers 4
        sliding = None if local is None else {"rope_type": "default", "rope_theta": local}
        return (*_one_rope(params, theta, where, key), sliding)
    full = _one_rope(dict(params["full_attention"]), theta, where, f"{key}.full_attention")
    local = _one_rope(dict(params.get("sliding_attention") or {}), theta, where, f"{key}.sliding_attention")
    sliding = None if local == full else {"rope_type": "default", **(local[1] or {}), "rope_theta": local[0]}
    return (*full, sliding)


def _one_rope(params: dict, theta: float, where: str, key: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) of one rope_parameters dict (its partial_rotary_factor is read apart)."""
    theta = params.pop("rope_theta", theta)
    params.pop("partial_rotary_factor", None)
    if "type" in params:  # transformers 4's spelling of rope_type
        params.setdefault("rope_type", params.pop("type"))
    if params.get("rope_type", "default") == "default":
        return theta, None
    problem = rope_problem(params)
    if problem:
        raise CheckpointError(f"{where}: {key}: {problem}")
    return theta, params


def _nope_layers(hf: dict, layers: int) -> list[int] | None:
    """SmolLM3's no_rope_layers (1: RoPE, 0: none, per layer; SmolLM3Config's default: every
    no_rope_layer_interval-th layer without) as the indices of the layers without RoPE."""
    flags = hf.get("no_rope_layers")
    if flags is None:
        interval = hf.get("no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    return [i for i, flag in enumerate(flags) if not flag] or None


def _window_values(hf: dict, family, layers: int, defaults: dict) -> dict:
    """sliding_window and layer_types as the family's transformers class reads them: Qwen's
    only with use_sliding_window, on the layers from max_window_layers on (or its layer_types)."""
    windowed = hf.get("use_sliding_window", False) if family.window_switch else True
    window = hf.get("sliding_window", defaults["sliding_window"]) if windowed else None
    if window is None:
        return {"sliding_window": None, "layer_types": None}
    types = hf.get("layer_types") if family.window_switch or family.layer_rope or family.types_key else None
    if family.types_key and types is None:  # GptOssConfig's default: sliding, full, sliding, ...
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if family.window_switch and types is None:
        start = hf.get("max_window_layers", defaults["max_window_layers"])
        types = ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
    if types is not None and all(t == "sliding_attention" for t in types):
        types = None
    return {"sliding_window": window, "layer_types": None if types is None else list(types)}


def hf_model_values(hf: dict, where: str) -> dict:
    """A Hugging Face config.json of a supported family as recipe `model` fields; what cannot run is refused."""
    kind = hf.get("model_type", "llama")
    _refuse_unsupported(hf, kind, where)
    family = FAMILIES[BY_MODEL_TYPE[kind]]
    defaults = family_defaults(kind)
    values = {key: hf.get(key, defaults[key]) for key in HF_DEFAULTS}
    if family.experts:
        values.update(_moe_values(hf, kind))
    kv_heads = hf.get("num_key_value_heads", defaults["num_key_value_heads"])
    values["num_key_value_heads"] = kv_heads or values["num_attention_heads"]
    head_dim = hf.get("head_dim", defaults["head_dim"])
    if family.mla:  # every head has its own key and value; transformers' head_dim is the RoPE width.
        values.update({key: hf.get(key, default) for key, default in MLA_DEFAULTS.items()})
        values["num_key_value_heads"], head_dim = values["num_attention_heads"], values["qk_rope_head_dim"]
    if family.prediction_layers:  # DeepSeek-V3's and GLM-4.5's MTP layers are read (models/mtp.py); transformers
        # ignores them (GLM's class calls the key num_mtp_layers, config.json num_nextn_predict_layers)
        values["num_nextn_predict_layers"] = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0
    rope_params = hf.get("rope_parameters") or {}
    partial = rope_params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0 and not family.partial_rotary:
        raise CheckpointError(
            f"{where}: rope_parameters: partial_rotary_factor={partial}: only 1.0 (RoPE on the whole head) "
            f"for model_type {kind!r}; glm4_moe has partial rotary"
        )
    values.update({"partial_rotary_factor": partial} if partial != 1.0 else {})
    values.update({"use_qk_norm": bool(hf.get("use_qk_norm", False))} if family.qk_norm_key else {})
    values["rope_theta"], values["rope_scaling"], sliding_rope = _rope_from_hf(hf, where, defaults["rope_theta"])
    values.update({"sliding_rope": sliding_rope} if sliding_rope else {})
    values.update(
        family=BY_MODEL_TYPE[kind],
        head_dim=head_dim,
        **_window_values(hf, family, values["num_hidden_layers"], defaults),
        **({"nope_layers": _nope_layers(hf, values["num_hidden_layers"])} if family.nope else {}),
        hidden_act=hf.get("hidden_activation") or hf.get("hidden_act", "silu"),
        **({"query_pre_attn_scalar": hf.get("query_pre_attn_scalar", 256)} if family.sandwich_norms else {}),
        **{key: bool(hf.get(key, kind == "gpt_oss")) for key in family.biases},  # GptOssConfig's: True
    )
    return values


def read_config_json(hf_dir: str, what: str) -> dict:
    """DIR/config.json as a dict; one CheckpointError line when DIR or the file is missing or unreadable."""
    if not os.path.isdir(hf_dir):
        raise CheckpointError(f"{what}={hf_dir!r}: no such directory; give a Hugging Face Llama directory")
    path = os.path.join(hf_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"Hugging Face config {path} is missing") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"Hugging Face config {path} is not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"Hugging Face config {path} must hold a JSON object")
    return data
