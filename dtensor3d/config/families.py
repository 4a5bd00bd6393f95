"""Model families as data: which Hugging Face model_type / architecture each one is, and the
model switches it turns on. Adding a family is a row here (and, for a new kind of layer, one
switch in models/); nothing else asks which family a model is. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    model_type: str  # Hugging Face config.json's model_type
    architecture: str  # ...and its architectures[0]
    qkv_bias: bool = False  # biases on q/k/v whatever attention_bias says (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    experts: bool = False  # Mixtral's mixture-of-experts names and config keys
    biases: tuple[str, ...] = ()  # which of attention_bias / mlp_bias the family's config class has
    window_switch: bool = False  # sliding_window counts only with use_sliding_window: true (Qwen)
    mla: bool = False  # multi-head latent attention (DeepSeek-V3: models/mla.py) instead of q/k/v heads
    hf_moe: str = "block_sparse_moe"  # the MoE block's name there: Mixtral's, or `mlp` (Qwen3-MoE, DeepSeek-V3)
    correction_bias: bool = False  # the router always has e_score_correction_bias (DeepSeek-V3)
    post_norms: bool = False  # RMSNorm after attention and after the MLP, none before (OLMo 2)
    qk_norm_whole: bool = False  # the q/k RMSNorm spans the whole projection, not each head (OLMo 2)
    nope: bool = False  # some layers without RoPE: config.json's no_rope_layers (SmolLM3)
    layer_rope: bool = False  # rope_parameters per layer type (OLMo 3, Gemma 3): sliding_rope
    sandwich_norms: bool = False  # norms before and after attention and the MLP (Gemma 3)
    norm_offset: bool = False  # RMSNorm scales by 1 + weight (Gemma)
    embed_scale: bool = False  # the embedding times sqrt(hidden_size) (Gemma)
    o_bias: bool = True  # attention_bias covers o_proj too (not GLM-4.5's: q/k/v only)
    partial_rotary: bool = False  # RoPE may cover part of each head: partial_rotary_factor (GLM-4.5)
    qk_norm_key: bool = False  # config.json's use_qk_norm turns the per-head q/k norm on (GLM-4.5)
    prediction_layers: bool = False  # the checkpoint may hold multi-token prediction layers past the last, unread
    fused: bool = False  # the checkpoint fuses q/k/v into qkv_proj and gate/up into gate_up_proj (Phi-3)
    sinks: bool = False  # a learned logit per head in each row's attention softmax (gpt-oss: self_attn.sinks)
    expert_bias: bool = False  # experts and router with biases, gate/up interleaved in gate_up_proj (gpt-oss)
    types_key: bool = False  # config.json's layer_types picks the sliding layers (gpt-oss: every other one)


FAMILIES = {
    "llama": Family("llama", "LlamaForCausalLM", biases=("attention_bias", "mlp_bias")),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True, window_switch=True),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", qk_norm=True, biases=("attention_bias",), window_switch=True),
    "mistral": Family("mistral", "MistralForCausalLM"),
    "mixtral": Family("mixtral", "MixtralForCausalLM", experts=True),
    "deepseek_v3": Family(
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        experts=True,
        biases=("attention_bias",),
        mla=True,
        hf_moe="mlp",
        correction_bias=True,
        prediction_layers=True,
    ),
    "qwen3_moe": Family(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        qk_norm=True,
        experts=True,
        biases=("attention_bias",),
        window_switch=True,
        hf_moe="mlp",
    ),
    "olmo2": Family(
        "olmo2", "Olmo2ForCausalLM", qk_norm=True, biases=("attention_bias",), post_norms=True, qk_norm_whole=True
    ),
    "olmo3": Family(
        "olmo3",
        "Olmo3ForCausalLM",
        qk_norm=True,
        biases=("attention_bias",),
        post_norms=True,
        qk_norm_whole=True,
        layer_rope=True,
    ),
    "gemma3_text": Family(
        "gemma3_text",
        "Gemma3ForCausalLM",
        qk_norm=True,
        biases=("attention_bias",),
        layer_rope=True,
        sandwich_norms=True,
        norm_offset=True,
        embed_scale=True,
    ),
    "glm4_moe": Family(
        "glm4_moe",
        "Glm4MoeForCausalLM",
        experts=True,
        biases=("attention_bias",),
        hf_moe="mlp",
        correction_bias=True,
        o_bias=False,
        partial_rotary=True,
        qk_norm_key=True,
        prediction_layers=True,
    ),
    "phi3": Family("phi3", "Phi3ForCausalLM", fused=True),
    "gpt_oss": Family(
        "gpt_oss",
        "GptOssForCausalLM",
        experts=True,
        biases=("attention_bias",),
        hf_moe="mlp",
        sinks=True,
        expert_bias=True,
        types_key=True,
    ),
    "smollm3": Family(
        "smollm3", "SmolLM3ForCausalLM", biases=("attention_bias", "mlp_bias"), window_switch=True, nope=True
    ),
}
BY_MODEL_TYPE = {f.model_type: name for name, f in FAMILIES.items()}

# rope_scaling's rope_type -> the keys it needs (beyond rope_type and factor)
ROPE_TYPES = {
    "default": (),
    "linear": (),
    "llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
}
ROPE_OPTIONAL = {
    "yarn": ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"),
}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def rope_problem(rope: dict | None) -> str | None:
    """Why model.rope_scaling cannot run (one phrase, naming the key), or None."""
    if rope is None:
        return None
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        return f"rope_type={kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
    if kind != "default" and not _positive(rope.get("factor")):
        return f"rope_type={kind!r} needs factor > 0 (got {rope.get('factor')!r})"
    allowed = {"rope_type", "type", "factor", "rope_theta", *ROPE_TYPES[kind], *ROPE_OPTIONAL.get(kind, ())}
    for key in ROPE_TYPES[kind]:
        if not _positive(rope.get(key)):
            return f"rope_type={kind!r} needs {key} > 0 (got {rope.get(key)!r})"
    unknown = sorted(set(rope) - allowed)
    if unknown:
        return f"{unknown[0]}: not a {kind!r} key; valid: {', '.join(sorted(allowed))}"
    return None


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
