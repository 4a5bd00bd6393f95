"""nanotron keys: every key of a nanotron config and its fate (copied, computed, approximated,
ignored or refused: the tables), reading a config into its leaves (`flatten`, one error
naming every unknown key) and key=value overrides in either spelling (nanotron's or the
recipe's: `split_overrides`). nanotron.py maps the leaves onto a Recipe. Never imports torch.
"""

from __future__ import annotations

import difflib
from typing import Any

import yaml

from ..errors import RecipeError

NANOTRON_SECTIONS = ("general", "tokens", "checkpoints", "data_stages", "tokenizer", "profiler", "lighteval")
REQUIRED = object()  # a nanotron field with no default


class Refusal(Exception):
    """A value that would change the maths and that dtensor3d cannot honour."""

    def __init__(self, path: str, value: Any, why: str):
        super().__init__(f"{path}={value!r} ({why})")


# nanotron path -> (recipe field, nanotron's default): copied as they are ('*': a data stage).
DIRECT: dict[str, tuple[str, Any]] = {
    "parallelism.dp": ("parallelism.dp", REQUIRED),
    "parallelism.tp": ("parallelism.tp", REQUIRED),
    "parallelism.pp": ("parallelism.pp", REQUIRED),
    "parallelism.pp_engine": ("parallelism.pp_engine", "afab"),
    "parallelism.tp_mode": ("parallelism.tp_mode", "ALL_REDUCE"),
    "parallelism.tp_linear_async_communication": ("parallelism.tp_linear_async_communication", False),
    "parallelism.recompute_layer": ("parallelism.recompute_layer", False),
    "parallelism.context_parallel_size": ("parallelism.cp", 1),
    "parallelism.expert_parallel_size": ("parallelism.ep", 1),
    "model.model_config.hidden_size": ("model.hidden_size", 4096),
    "model.model_config.intermediate_size": ("model.intermediate_size", 11008),
    "model.model_config.num_hidden_layers": ("model.num_hidden_layers", 32),
    "model.model_config.num_attention_heads": ("model.num_attention_heads", 32),
    "model.model_config.rms_norm_eps": ("model.rms_norm_eps", 1e-6),
    "model.model_config.rope_theta": ("model.rope_theta", 10000.0),
    "model.model_config.max_position_embeddings": ("model.max_position_embeddings", 2048),
    "model.model_config.tie_word_embeddings": ("model.tie_word_embeddings", False),
    "tokens.sequence_length": ("training.sequence_length", REQUIRED),
    "tokens.train_steps": ("training.steps", REQUIRED),
    "tokens.micro_batch_size": ("training.micro_batch_size", REQUIRED),
    "optimizer.weight_decay": ("optimizer.weight_decay", REQUIRED),
    "optimizer.learning_rate_scheduler.learning_rate": ("optimizer.lr", REQUIRED),
    "optimizer.learning_rate_scheduler.lr_warmup_steps": ("optimizer.warmup_steps", 0),
    "optimizer.optimizer_factory.adam_eps": ("optimizer.eps", REQUIRED),
    "checkpoints.checkpoints_path": ("checkpoint.dir", REQUIRED),
    "checkpoints.checkpoint_interval": ("checkpoint.interval", REQUIRED),
    "logging.iteration_step_info_interval": ("logging.every", 1),
}

# Keys read by the computed mappings below (`_computed`).
COMPUTED = {
    "general.seed",
    "model.dtype",
    "model.make_vocab_size_divisible_by",
    "model.model_config.vocab_size",
    "model.model_config.num_key_value_heads",
    "tokens.batch_accumulation_per_replica",
    "optimizer.zero_stage",
    "optimizer.clip_grad",
    "optimizer.optimizer_factory.adam_beta1",
    "optimizer.optimizer_factory.adam_beta2",
    "optimizer.learning_rate_scheduler.lr_warmup_style",
    "optimizer.learning_rate_scheduler.lr_decay_style",
    "optimizer.learning_rate_scheduler.lr_decay_steps",
    "optimizer.learning_rate_scheduler.lr_decay_starting_step",
    "optimizer.learning_rate_scheduler.min_decay_lr",
    "checkpoints.resume_checkpoint_path",
    "profiler.profiler_export_path",
    "profiler.wait",
    "profiler.warmup",
    "profiler.active",
    "profiler.repeat",
    "profiler.skip_first",
    "data_stages",
    "data_stages.*.name",
    "data_stages.*.start_training_step",
    "data_stages.*.sequence_length",
    "data_stages.*.data.dataset",
}

# nanotron path -> (accepted values, what dtensor3d does instead): any other value is refused.
REFUSED: dict[str, tuple[tuple, str]] = {
    "model.model_config.hidden_act": (("silu",), "the MLP is SwiGLU with silu"),
    "model.model_config.rope_scaling": ((None,), "RoPE is unscaled"),
    "model.model_config.rope_interleaved": ((False,), "RoPE rotates halves (Hugging Face's layout)"),
    "model.model_config.rope_seq_len_interpolation_factor": ((None,), "RoPE positions are not interpolated"),
    "model.model_config.attention_bias": ((False,), "attention projections have no bias"),
    "model.model_config.z_loss_enabled": ((False,), "the loss is plain cross-entropy, no z-loss"),
    "model.model_config.sliding_window_size": ((None,), "attention is full causal"),
    "model.model_config.flex_attention_mask": ((None,), "attention is full causal"),
    "model.model_config._use_doc_masking": ((False,), "attention is full causal, across documents"),
    "model.model_config.no_rope_layer": ((None,), "every layer has RoPE"),
    "model.model_config.moe_config": (
        (None,),
        "nanotron's Qwen2 MoE (unnormalised top-k, gated shared expert) differs from dtensor3d's "
        "Mixtral experts; write model.num_local_experts etc. in a recipe",
    ),
    "model.init_method.use_mup": ((None, False), "standard parametrisation only"),
    "model.init_method.path": ((None,), "nanotron checkpoints are not read; use checkpoint.init_from_hf"),
    "optimizer.optimizer_factory.name": (("adamW", "adamw"), "the optimizer is AdamW"),
    "checkpoints.load_optimizer": ((None, True), "a resume restores the optimizer"),
    "checkpoints.load_lr_scheduler": ((None, True), "a resume restores the schedule position"),
}

# Mapped to the nearest thing dtensor3d has; the warning says how.
APPROXIMATED = {
    "model.init_method.std": "every matrix starts at std 0.02, without nanotron's depth scaling",
    "model.init_method.scaling_method": "no depth scaling of the init",
    "optimizer.weight_decay_exclude_named_params": "weight decay applies to matrices only",
}

# No equivalent, and no effect on the maths of a run here.
IGNORED = {
    "general.project",
    "general.run",
    "general.step",
    "general.consumed_train_samples",
    "general.benchmark_csv_path",
    "general.ignore_sanity_checks",
    "parallelism.tp_recompute_allgather",
    "model.ddp_bucket_cap_mb",
    "model.model_config.bos_token_id",
    "model.model_config.eos_token_id",
    "model.model_config.pad_token_id",
    "model.model_config.initializer_range",
    "model.model_config.is_llama_config",
    "model.model_config.is_qwen2_config",
    "model.model_config.pretraining_tp",
    "model.model_config.use_cache",
    "model.model_config._attn_implementation",
    "model.model_config._fused_rotary_emb",
    "model.model_config._fused_rms_norm",
    "model.model_config._use_qkv_packed",
    "model.model_config.log_attn_probs",
    "model.model_config.ring_attn_heads_k_stride",
    "tokens.val_check_interval",
    "tokens.limit_val_batches",
    "tokens.limit_test_batches",
    "optimizer.accumulate_grad_in_fp32",
    "optimizer.optimizer_factory.torch_adam_is_fused",
    "checkpoints.save_initial_state",
    "checkpoints.save_final_state",
    "checkpoints.checkpoints_path_is_shared_file_system",
    "data_stages.*.data.seed",
    "data_stages.*.data.num_loading_workers",
    "logging.log_level",
    "logging.log_level_replica",
    "tokenizer.tokenizer_name_or_path",
    "tokenizer.tokenizer_revision",
    "tokenizer.tokenizer_max_length",
    "profiler.record_shapes",
    "profiler.profile_memory",
    "profiler.with_stack",
    "profiler.export_chrome_trace",
    "lighteval",
    "s3_upload",
    "metrics_logging",
}
# Values kept whole (a mapping that is itself the value, or a section ignored as a whole).
LEAVES = {
    "model.model_config.rope_scaling",
    "model.model_config.moe_config",
    "data_stages.*.data.dataset",
    "lighteval",
    "s3_upload",
    "metrics_logging",
}
KNOWN = set(DIRECT) | COMPUTED | set(REFUSED) | set(APPROXIMATED) | IGNORED


def is_nanotron(raw: dict) -> bool:
    """A nanotron config has its model under `model.model_config`, or at least two of the sections
    no recipe has (`general`, `tokens`, ...). One stray section such as `tokenizer:` in a recipe
    is not enough: it is reported as an unknown section of the recipe."""
    model = raw.get("model")
    if isinstance(model, dict) and "model_config" in model:
        return True
    return sum(s in raw for s in NANOTRON_SECTIONS) >= 2


def schema_path(parts: list[str]) -> str:
    """data_stages.0.data.seed -> data_stages.*.data.seed (the form the tables use)."""
    return ".".join("*" if p.isdigit() else p for p in parts)


PREFIXES = {k.rsplit(".", n)[0] for k in KNOWN for n in range(1, k.count(".") + 1)}


def flatten(raw: dict) -> dict[str, Any]:
    """Every leaf of a nanotron config as {'a.b.c': value} ({'data_stages.0.name': ...} for
    the stages); raises one RecipeError naming every key nanotron does not have."""
    flat: dict[str, Any] = {}
    unknown: list[str] = []

    def walk(parts: list[str], value: Any) -> None:
        schema = schema_path(parts)
        if isinstance(value, dict) and schema not in LEAVES and (schema in PREFIXES or not parts):
            for key, sub in value.items():
                walk(parts + [str(key)], sub)
        elif schema == "data_stages" and isinstance(value, list):
            flat[schema] = value
            for i, stage in enumerate(value):
                walk(parts + [str(i)], stage)
        elif schema in KNOWN:
            flat[".".join(parts)] = value
        elif schema in PREFIXES and value is None:
            pass  # an empty section: nanotron's defaults
        elif schema in PREFIXES:
            raise RecipeError(f"nanotron config: {'.'.join(parts)}={value!r} must be a mapping of keys to values")
        else:
            unknown.append(".".join(parts))

    walk([], raw)
    if unknown:
        hints = [f"{u} ({hint(u)})" for u in unknown]
        raise RecipeError(f"nanotron config: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(hints)}")
    return flat


def hint(path: str) -> str:
    parts = path.split(".")
    depth, parent = len(parts) - 1, schema_path(parts[:-1])
    siblings = sorted(
        {
            k.split(".")[depth]
            for k in KNOWN | PREFIXES
            if k.count(".") >= depth and schema_path(k.split(".")[:depth]) == parent
        }
    )
    close = difflib.get_close_matches(parts[-1], siblings, n=1)
    return f"did you mean '{close[0]}'?" if close else f"valid here: {', '.join(siblings)}"


# recipe field -> the one nanotron key it is copied from (a recipe-spelled override sets that key).
REVERSE = {field: path for path, (field, _) in DIRECT.items()} | {
    "training.seed": "general.seed",
    "training.dtype": "model.dtype",
    "model.num_key_value_heads": "model.model_config.num_key_value_heads",
}


RECIPE_SECTIONS = ("model", "parallelism", "training", "optimizer", "data", "checkpoint", "logging", "eval")


def recipe_key(parts: list[str]) -> str | None:
    """'training.steps' -> 'training.steps': a key in recipe spelling (recipe.py checks it)."""
    return ".".join(parts) if len(parts) == 2 and parts[0] in RECIPE_SECTIONS else None


def _value(text: str, raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        raise RecipeError(f"override {text!r}: value {raw!r} is not a YAML value") from None


def split_overrides(overrides) -> tuple[list[tuple[list[str], Any]], list[str]]:
    """key=value overrides in nanotron spelling (applied to the config) and in recipe spelling
    (applied to the recipe after mapping). A key both have (parallelism.tp) is nanotron's."""
    nano, recipe, given = [], [], {}
    for text in overrides:
        path, eq, raw = text.partition("=")
        if not eq:
            raise RecipeError(f"override {text!r} has no '='; expected key.path=value, e.g. tokens.train_steps=20")
        parts = path.strip().split(".")
        value = _value(text, raw)
        if recipe_key(parts) in REVERSE:  # a recipe field copied from one nanotron key: set that key
            parts = REVERSE[recipe_key(parts)].split(".")
        if schema_path(parts) in KNOWN:
            if ".".join(parts) in given:
                raise RecipeError(
                    f"override {text!r}: {'.'.join(parts)} is also set by {given['.'.join(parts)]!r}; give it once"
                )
            given[".".join(parts)] = text
            nano.append((parts, value))
        elif recipe_key(parts):
            recipe.append(text)
        else:
            raise RecipeError(
                f"override {text!r}: {path!r} is a key of neither a nanotron config nor a recipe ({hint(path.strip())})"
            )
    return nano, recipe


def set_path(raw: dict, parts: list[str], value: Any, text: str) -> None:
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise RecipeError(f"override {text}: {'.'.join(parts[: i + 1])}: there are {len(node)} data stages")
            node = node[int(part)]
        else:
            if not isinstance(node.get(part), (dict, list)):
                node[part] = {}
            node = node[part]
    if isinstance(node, list):
        raise RecipeError(f"override {text}: give a key inside a data stage, e.g. data_stages.0.data.dataset=null")
    node[parts[-1]] = value
