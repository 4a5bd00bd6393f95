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
# ModelConfig fields that a Llama config.json holds under the same name.
LLAMA_KEYS = (*HF_DEFAULTS, "num_key_value_heads", "rope_theta")
# ...and the ones a Mixtral config.json adds (with MixtralConfig's defaults).
MIXTRAL_DEFAULTS = {"num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001}
# ...and a Qwen3-MoE config.json's (Qwen3MoeConfig's defaults; it spells the expert count num_experts).
QWEN3_MOE_DEFAULTS = {
    "num_experts_per_tok": 8,
    "router_aux_loss_coef": 0.001,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 768,
}
QWEN3_MOE_KEYS = tuple(QWEN3_MOE_DEFAULTS)


def _moe_values(hf: dict, kind: str) -> dict:
    """The mixture-of-experts fields of a Mixtral or Qwen3-MoE config.json."""
    if kind == "mixtral":
        return {key: hf.get(key, default) for key, default in MIXTRAL_DEFAULTS.items()}
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
    if hf.get("hidden_act", "silu") not in ACTIVATIONS:
        raise refuse("hidden_act", f"supported: {', '.join(ACTIVATIONS)} (SwiGLU)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key) and key not in FAMILIES[BY_MODEL_TYPE[kind]].biases:
            raise refuse(key, f"not supported for model_type {kind!r}")
    if hf.get("attention_dropout", 0.0):
        raise refuse("attention_dropout", "dropout is not supported; use 0.0")


def _rope_from_hf(hf: dict, where: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from transformers 5's rope_parameters or 4's rope_theta and
    rope_scaling; the default RoPE is no scaling."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"  # a 4.x scaling wins
    theta = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0))
    params = dict(hf.get(key) or {})
    theta = params.pop("rope_theta", theta)
    if params.pop("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(f"{where}: {key}: partial_rotary_factor: only 1.0 (RoPE on the whole head) is supported")
    if "type" in params:  # transformers 4's spelling of rope_type
        params.setdefault("rope_type", params.pop("type"))
    if params.get("rope_type", "default") == "default":
        return theta, None
    problem = rope_problem(params)
    if problem:
        raise CheckpointError(f"{where}: {key}: {problem}")
    return theta, params


def hf_model_values(hf: dict, where: str) -> dict:
    """A Hugging Face config.json of a supported family as recipe `model` fields; what cannot run is refused."""
    kind = hf.get("model_type", "llama")
    _refuse_unsupported(hf, kind, where)
    family = FAMILIES[BY_MODEL_TYPE[kind]]
    values = {key: hf.get(key, default) for key, default in HF_DEFAULTS.items()}
    if family.experts:
        values.update(_moe_values(hf, kind))
    values["num_key_value_heads"] = hf.get("num_key_value_heads") or values["num_attention_heads"]
    values["rope_theta"], values["rope_scaling"] = _rope_from_hf(hf, where)
    windowed = hf.get("use_sliding_window", False) if family.window_switch else True
    values.update(
        family=BY_MODEL_TYPE[kind],
        head_dim=hf.get("head_dim"),
        sliding_window=hf.get("sliding_window") if windowed else None,
        **{key: bool(hf.get(key, False)) for key in family.biases},
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
