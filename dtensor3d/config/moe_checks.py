"""The recipe's checks for multi-head latent attention and mixtures of experts (routers,
groups, experts per rank): part of config.checks.validate, one error line each."""

from __future__ import annotations

from ..errors import RecipeError
from .schema import ModelConfig, ParallelismConfig


def validate_mla(m: ModelConfig, p: ParallelismConfig) -> None:
    """Multi-head latent attention's widths: every head has its own key and value (from the
    latent), and the RoPE part rotates pairs."""
    if m.num_key_value_heads != m.num_attention_heads:
        raise RecipeError(
            f"model.num_key_value_heads={m.num_key_value_heads}: multi-head latent attention (family "
            f"{m.family!r}) gives every head its own key and value; set it to num_attention_heads="
            f"{m.num_attention_heads}"
        )
    if m.qk_rope_head_dim <= 0 or m.qk_rope_head_dim % 2:
        raise RecipeError(f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be a positive even number (RoPE pairs)")
    if m.head_dim != m.qk_rope_head_dim:
        raise RecipeError(
            f"model.head_dim={m.head_dim}: multi-head latent attention's head_dim is qk_rope_head_dim="
            f"{m.qk_rope_head_dim} (as in transformers' DeepseekV3Config); remove head_dim"
        )
    if p.tp_enabled and p.tp_linear_async_communication:
        raise RecipeError(
            "parallelism.tp_linear_async_communication=true: the overlapped tp path (parallel/async_tp.py) "
            "has no multi-head latent attention; set it to false for family 'deepseek_v3'"
        )
    if m.q_lora_rank is not None and m.q_lora_rank <= 0:
        raise RecipeError(f"model.q_lora_rank={m.q_lora_rank} must be > 0, or null for one full query projection")


def validate_experts(m: ModelConfig) -> None:
    if m.num_local_experts < 0:
        raise RecipeError(f"model.num_local_experts={m.num_local_experts} must be >= 0 (0: no experts)")
    if m.num_local_experts and not 1 <= m.num_experts_per_tok <= m.num_local_experts:
        raise RecipeError(
            f"model.num_experts_per_tok={m.num_experts_per_tok} must be in 1..num_local_experts={m.num_local_experts}"
        )
    if m.router_aux_loss_coef < 0 or m.shared_expert_intermediate_size < 0:
        raise RecipeError(
            f"model.router_aux_loss_coef={m.router_aux_loss_coef}, shared_expert_intermediate_size="
            f"{m.shared_expert_intermediate_size}: both must be >= 0"
        )
    if m.moe_layers is not None and (
        not m.num_local_experts or any(not 0 <= i < m.num_hidden_layers for i in m.moe_layers)
    ):
        raise RecipeError(
            f"model.moe_layers={list(m.moe_layers)} must list layer indices in 0.."
            f"{m.num_hidden_layers - 1} of a model with experts (num_local_experts > 0)"
        )
    if m.swiglu_limit is not None and not (m.num_local_experts and m.swiglu_limit > 0):
        raise RecipeError(
            f"model.swiglu_limit={m.swiglu_limit}: the clamped SwiGLU (gpt-oss) is the experts' and its limit is "
            f"> 0; give a model with experts (num_local_experts={m.num_local_experts}) or null (plain SwiGLU)"
        )
    if m.num_local_experts:
        validate_router(m)


def validate_router(m: ModelConfig) -> None:
    """Group-limited routing, the scaling factor, balancing and the layer pattern (models/moe.py)."""
    e, groups = m.num_local_experts, m.n_group
    if e % groups or (groups > 1 and e // groups < 2):
        valid = ", ".join(str(g) for g in range(1, e + 1) if e % g == 0 and (g == 1 or e // g >= 2))
        raise RecipeError(
            f"model.n_group={groups}: num_local_experts={e} must split into n_group groups of "
            f">= 2 experts (the group score sums its top 2); valid n_group: {valid}"
        )
    if m.topk_group > groups:
        raise RecipeError(f"model.topk_group={m.topk_group} is larger than n_group={groups}; valid: 1..{groups}")
    if groups > 1 and m.num_experts_per_tok > m.topk_group * (e // groups):
        raise RecipeError(
            f"model.num_experts_per_tok={m.num_experts_per_tok}: topk_group={m.topk_group} groups of "
            f"{e // groups} experts hold only {m.topk_group * (e // groups)}; raise topk_group or lower top-k"
        )
    for key in ("routed_scaling_factor", "router_bias_update_rate", "moe_intermediate_size", "n_shared_experts"):
        if getattr(m, key) < 0 or (key == "routed_scaling_factor" and m.routed_scaling_factor == 0):
            raise RecipeError(f"model.{key}={getattr(m, key)} must be {'> 0' if key.startswith('routed') else '>= 0'}")
    if m.n_shared_experts and m.shared_expert_intermediate_size:
        raise RecipeError(
            f"model.n_shared_experts={m.n_shared_experts} with shared_expert_intermediate_size="
            f"{m.shared_expert_intermediate_size}: give one of them (DeepSeek's or Qwen2-MoE's), not both"
        )
    bad = [i for i in (m.mlp_only_layers or ()) if not 0 <= i < m.num_hidden_layers]
    if bad or m.first_k_dense_replace < 0:
        raise RecipeError(
            f"model.mlp_only_layers={list(m.mlp_only_layers or ())}, first_k_dense_replace={m.first_k_dense_replace}: "
            f"layer indices must be in 0..{m.num_hidden_layers - 1}"
        )
