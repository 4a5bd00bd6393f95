"""nanotron configs: a nanotron YAML config (general, parallelism, model, tokens, optimizer,
checkpoints, data_stages, logging, tokenizer, profiler) read field by field onto a Recipe.

Every key of the config is one of: mapped (copied or computed onto a recipe field, the
source named in `convert-nanotron`'s comments), ignored (no effect on the maths here: one
warning line lists them), approximated (mapped to the nearest thing dtensor3d has: named in
the same warning) or refused (a value that would change the maths and that dtensor3d cannot
honour: one `error:` line names them all). Like recipe.py, this module never imports torch.
"""

from __future__ import annotations

import difflib
import math
import sys
from dataclasses import dataclass
from typing import Any

import yaml

from ..errors import RecipeError, is_rank0

# Top-level sections only a nanotron config has (a recipe has `checkpoint`, nanotron `checkpoints`).
NANOTRON_SECTIONS = ("general", "tokens", "checkpoints", "data_stages", "tokenizer", "profiler", "lighteval")
REQUIRED = object()  # a nanotron field with no default

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


def _schema(parts: list[str]) -> str:
    """data_stages.0.data.seed -> data_stages.*.data.seed (the form the tables use)."""
    return ".".join("*" if p.isdigit() else p for p in parts)


PREFIXES = {k.rsplit(".", n)[0] for k in KNOWN for n in range(1, k.count(".") + 1)}


def flatten(raw: dict) -> dict[str, Any]:
    """Every leaf of a nanotron config as {'a.b.c': value} ({'data_stages.0.name': ...} for
    the stages); raises one RecipeError naming every key nanotron does not have."""
    flat: dict[str, Any] = {}
    unknown: list[str] = []

    def walk(parts: list[str], value: Any) -> None:
        schema = _schema(parts)
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
        hints = [f"{u} ({_hint(u)})" for u in unknown]
        raise RecipeError(f"nanotron config: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(hints)}")
    return flat


def _hint(path: str) -> str:
    parts = path.split(".")
    depth, parent = len(parts) - 1, _schema(parts[:-1])
    siblings = sorted(
        {
            k.split(".")[depth]
            for k in KNOWN | PREFIXES
            if k.count(".") >= depth and _schema(k.split(".")[:depth]) == parent
        }
    )
    close = difflib.get_close_matches(parts[-1], siblings, n=1)
    return f"did you mean '{close[0]}'?" if close else f"valid here: {', '.join(siblings)}"


class _Reader:
    """Reads a flattened config with nanotron's defaults; `value` None counts as unset."""

    def __init__(self, flat: dict[str, Any]):
        self.flat = flat

    def get(self, path: str, default: Any = None) -> Any:
        value = self.flat.get(path)
        if value is None:
            if default is REQUIRED:
                raise RecipeError(f"nanotron config: {path} is required (nanotron has no default for it)")
            return default
        return value

    def given(self, path: str) -> bool:
        return self.flat.get(path) is not None


Fields = dict[str, tuple[Any, str]]  # recipe "section.key" -> (value, where it came from)


def _direct(r: _Reader) -> Fields:
    out: Fields = {}
    for path, (field, default) in DIRECT.items():
        if r.given(path):
            out[field] = (r.flat[path], path)
        elif default is not REQUIRED:
            out[field] = (default, f"{path} unset: nanotron's default")
        elif path.startswith("checkpoints.") and not any(k.startswith("checkpoints.") for k in r.flat):
            continue  # no checkpoints section: no checkpoints
        else:
            r.get(path, REQUIRED)
    return out


def _model(r: _Reader) -> Fields:
    mc = "model.model_config"
    heads = r.get(f"{mc}.num_attention_heads", 32)
    vocab, multiple = (
        r.get(f"{mc}.vocab_size", 32000),
        r.get("model.make_vocab_size_divisible_by", 1) * r.get("parallelism.tp", 1),
    )
    padded = math.ceil(vocab / multiple) * multiple
    pad_note = (
        f", {vocab} padded to a multiple of make_vocab_size_divisible_by*tp = {multiple}" if padded != vocab else ""
    )
    kv = r.get(f"{mc}.num_key_value_heads")
    dtype = r.get("model.dtype", "bfloat16")
    if dtype not in ("bfloat16", "float32"):
        raise _Refusal("model.dtype", dtype, "valid: bfloat16 (autocast), float32")
    return {
        "model.vocab_size": (padded, f"{mc}.vocab_size{pad_note}"),
        "model.num_key_value_heads": (
            kv or heads,
            f"{mc}.num_key_value_heads" if kv else f"{mc}.num_attention_heads (num_key_value_heads unset)",
        ),
        "training.dtype": (dtype, "model.dtype (bfloat16: autocast over fp32 master weights)"),
    }


def _training(r: _Reader) -> Fields:
    mbs, acc = r.get("tokens.micro_batch_size", REQUIRED), r.get("tokens.batch_accumulation_per_replica", REQUIRED)
    dp, ep = r.get("parallelism.dp", REQUIRED), r.get("parallelism.expert_parallel_size", 1)
    seed = r.get("general.seed")
    zero = r.get("optimizer.zero_stage", 0)
    if zero not in (0, 1):
        raise _Refusal("optimizer.zero_stage", zero, "valid: 0 (replicated), 1 (sharded)")
    return {
        "training.global_batch_size": (
            mbs * acc * dp * ep,
            f"tokens.micro_batch_size * batch_accumulation_per_replica * parallelism.dp * ep = {mbs}*{acc}*{dp}*{ep}",
        ),
        "training.seed": (
            42 if seed is None else seed,
            "general.seed" if seed is not None else "general.seed unset: nanotron's 42",
        ),
        "parallelism.dp_mode": (
            "replicate" if zero == 0 else "shard",
            f"optimizer.zero_stage {zero}: "
            + ("replicated weights, all-reduced gradients" if zero == 0 else "sharded (FSDP2)"),
        ),
    }


def _optimizer(r: _Reader) -> Fields:
    fac, clip = "optimizer.optimizer_factory", r.get("optimizer.clip_grad")
    b1, b2 = r.get(f"{fac}.adam_beta1", REQUIRED), r.get(f"{fac}.adam_beta2", REQUIRED)
    return {
        "optimizer.betas": ([b1, b2], f"{fac}.adam_beta1, adam_beta2"),
        "optimizer.clip_grad": (
            0.0 if clip is None else clip,
            "optimizer.clip_grad" + (" unset: no clipping" if clip is None else ""),
        ),
    } | _schedule(r)


def _schedule(r: _Reader) -> Fields:
    """nanotron's LambdaLR: linear warmup, then cosine/linear decay over lr_decay_steps from
    lr_decay_starting_step, then min_decay_lr. dtensor3d decays from the warmup's end to the
    last step; other shapes are refused."""
    s = "optimizer.learning_rate_scheduler"
    lr, warmup, steps = (
        r.get(f"{s}.learning_rate", REQUIRED),
        r.get(f"{s}.lr_warmup_steps", 0),
        r.get("tokens.train_steps", REQUIRED),
    )
    if r.get(f"{s}.lr_warmup_style", "linear") != "linear" and warmup:
        raise _Refusal(f"{s}.lr_warmup_style", r.get(f"{s}.lr_warmup_style"), "warmup is linear")
    style = r.get(f"{s}.lr_decay_style", "linear")
    if style not in ("cosine", "linear"):
        raise _Refusal(f"{s}.lr_decay_style", style, "valid: cosine, linear")
    start = r.get(f"{s}.lr_decay_starting_step")
    if start is not None and start != warmup:
        raise _Refusal(
            f"{s}.lr_decay_starting_step", start, f"decay starts where warmup ends (lr_warmup_steps={warmup})"
        )
    decay = r.get(f"{s}.lr_decay_steps")
    decay = steps - warmup - (start or 0) if decay is None else decay
    if decay != steps - warmup:
        raise _Refusal(
            f"{s}.lr_decay_steps",
            decay,
            f"decay runs to the last step: train_steps - lr_warmup_steps = {steps - warmup}",
        )
    min_lr = r.get(f"{s}.min_decay_lr")
    return {
        "optimizer.decay": (style, f"{s}.lr_decay_style over lr_decay_steps={decay}"),
        "optimizer.min_lr": (
            lr if min_lr is None else min_lr,
            f"{s}.min_decay_lr" + (" unset: learning_rate" if min_lr is None else ""),
        ),
    }


class _Refusal(Exception):
    """A value that would change the maths and that dtensor3d cannot honour."""

    def __init__(self, path: str, value: Any, why: str):
        super().__init__(f"{path}={value!r} ({why})")


def _checkpoint(r: _Reader) -> Fields:
    resume = r.get("checkpoints.resume_checkpoint_path")
    if resume is not None:
        return {"checkpoint.resume": (str(resume), "checkpoints.resume_checkpoint_path")}
    if r.given("checkpoints.checkpoints_path"):
        why = "checkpoints.resume_checkpoint_path unset: auto, the newest complete checkpoint in checkpoint.dir"
        return {"checkpoint.resume": ("auto", why)}
    return {}


def _data(r: _Reader) -> Fields:
    """One data stage: nanotron's dummy data (dataset null) -> synthetic, or a token file."""
    stages = r.get("data_stages") or []
    if len(stages) > 1:
        raise _Refusal(
            "data_stages", [s.get("name") for s in stages], "one data stage per run; run each stage as its own recipe"
        )
    if not stages:
        return {"data.kind": ("synthetic", "data_stages unset: synthetic tokens (nanotron: dummy data)")}
    seq = r.get("data_stages.0.sequence_length")
    if seq is not None and seq != r.get("tokens.sequence_length"):
        raise _Refusal("data_stages.0.sequence_length", seq, "the stage trains at tokens.sequence_length")
    dataset = r.get("data_stages.0.data.dataset")
    if dataset is None:
        return {"data.kind": ("synthetic", "data_stages.0.data.dataset null: synthetic tokens (nanotron: dummy data)")}
    folder = dataset.get("dataset_folder") if isinstance(dataset, dict) else None
    if isinstance(folder, list) and len(folder) == 1:
        folder = folder[0]
    if isinstance(folder, str) and folder.endswith((".npy", ".bin")):
        return {
            "data.kind": ("tokens", "data_stages.0.data.dataset.dataset_folder: a token file"),
            "data.path": (folder, "data_stages.0.data.dataset.dataset_folder"),
        }
    raise _Refusal(
        "data_stages.0.data.dataset",
        dataset,
        "give a token file: python -m dtensor3d prepare-data, then data.kind=tokens data.path=FILE",
    )


def _profiler(r: _Reader) -> Fields:
    """nanotron's torch.profiler schedule (skip_first, then wait, warmup, active steps) -> the
    1-based steps it records; dtensor3d writes the traces to <run_dir>/profile."""
    if not r.given("profiler.profiler_export_path"):
        return {}
    p = {k: r.get(f"profiler.{k}", d) for k, d in (("skip_first", 3), ("wait", 1), ("warmup", 1), ("active", 1))}
    first = p["skip_first"] + p["wait"] + p["warmup"] + 1
    last, steps = first + p["active"] - 1, r.get("tokens.train_steps", REQUIRED)
    if last > steps:
        raise _Refusal("profiler", p, f"it profiles steps {first}..{last}, past tokens.train_steps={steps}")
    why = "profiler: steps skip_first + wait + warmup + 1 .. + active - 1 (repeat: once), traces in run_dir/profile"
    return {"logging.profile_steps": ([first, last], why)}


def _refusals(flat: dict[str, Any]) -> list[str]:
    out = []
    for path, value in flat.items():
        accepted, why = REFUSED.get(_schema(path.split(".")), ((value,), ""))
        if value not in accepted:
            out.append(f"{path}={value!r} ({why})")
    return out


def _map(flat: dict[str, Any], skip: set[str]) -> tuple[Fields, list[str]]:
    """Every recipe field the config sets, and every refusal (a mapping whose recipe fields
    are all given as recipe-spelled overrides (`skip`) is not read)."""
    r, fields, refused = _Reader(flat), {}, _refusals(flat)
    steps = {
        _direct: None,
        _model: None,
        _training: None,
        _optimizer: None,
        _checkpoint: None,
        _profiler: None,
        _data: {"data.kind", "data.path"},
    }
    for fn, produces in steps.items():
        if produces and produces & skip:
            continue
        try:
            fields.update(fn(r))
        except _Refusal as e:
            refused.append(str(e))
    return fields, refused


# recipe field -> the one nanotron key it is copied from (a recipe-spelled override sets that key).
REVERSE = {field: path for path, (field, _) in DIRECT.items()} | {
    "training.seed": "general.seed",
    "training.dtype": "model.dtype",
    "model.num_key_value_heads": "model.model_config.num_key_value_heads",
}


RECIPE_SECTIONS = ("model", "parallelism", "training", "optimizer", "data", "checkpoint", "logging")


def _recipe_key(parts: list[str]) -> str | None:
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
        if _recipe_key(parts) in REVERSE:  # a recipe field copied from one nanotron key: set that key
            parts = REVERSE[_recipe_key(parts)].split(".")
        if _schema(parts) in KNOWN:
            if ".".join(parts) in given:
                raise RecipeError(
                    f"override {text!r}: {'.'.join(parts)} is also set by {given['.'.join(parts)]!r}; give it once"
                )
            given[".".join(parts)] = text
            nano.append((parts, value))
        elif _recipe_key(parts):
            recipe.append(text)
        else:
            raise RecipeError(
                f"override {text!r}: {path!r} is a key of neither a nanotron config nor a recipe "
                f"({_hint(path.strip())})"
            )
    return nano, recipe


def _set(raw: dict, parts: list[str], value: Any, text: str) -> None:
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


@dataclass(frozen=True)
class Conversion:
    """A nanotron config as a recipe: recipe.py builds it as recipe_from_dict(fields, recipe_overrides)."""

    fields: dict[str, dict[str, Any]]  # recipe section -> key -> value
    recipe_overrides: tuple[str, ...]  # overrides in recipe spelling, applied after the mapping
    sources: dict[str, str]  # recipe "section.key" -> the nanotron key(s) or override it came from
    ignored: tuple[str, ...]  # nanotron keys with no equivalent and no effect on the maths
    approximated: tuple[str, ...]  # "key=value (what dtensor3d does)"


def convert(raw: dict, overrides=()) -> Conversion:
    """Map a nanotron config (a dict as read from YAML) and overrides onto recipe fields."""
    nano, recipe_over = split_overrides(overrides)
    raw = yaml.safe_load(yaml.safe_dump(raw))  # a deep copy the overrides may change
    for parts, value in nano:
        _set(raw, parts, value, ".".join(parts))
    flat = flatten(raw)
    skip = {_recipe_key(t.partition("=")[0].strip().split(".")) for t in recipe_over}
    fields, refused = _map(flat, skip)
    if refused:
        raise RecipeError(f"nanotron config: cannot honour {'; '.join(refused)}")
    nested: dict[str, dict] = {}
    for key, (value, _) in fields.items():
        section, name = key.split(".")
        nested.setdefault(section, {})[name] = value
    sources = {key: why for key, (_, why) in fields.items()}
    overridden = {".".join(parts) for parts, _ in nano}
    sources = {
        k: f"{why} (override)" if why.split(" ")[0].rstrip(",") in overridden else why for k, why in sources.items()
    }
    sources |= {_recipe_key(t.partition("=")[0].strip().split(".")): f"override {t}" for t in recipe_over}
    schema = {path: _schema(path.split(".")) for path in flat}
    ignored = tuple(p for p in flat if schema[p] in IGNORED and flat[p] is not None)
    approx = tuple(f"{p}={flat[p]!r} ({APPROXIMATED[schema[p]]})" for p in flat if schema[p] in APPROXIMATED)
    decay = nested.get("optimizer", {}).get("weight_decay")
    if decay:
        approx += (f"optimizer.weight_decay={decay} (matrices only; nanotron decays norm weights too)",)
    approx += (
        "optimizer.learning_rate_scheduler (warmup one step ahead: nanotron's first step runs at lr 0, "
        "dtensor3d's at lr/lr_warmup_steps, or lr without warmup; the decay is the same)",
    )
    return Conversion(nested, tuple(recipe_over), sources, ignored, approx)


def warning_line(conv: Conversion) -> str | None:
    parts = []
    if conv.ignored:
        parts.append(f"nanotron keys with no effect on the maths here, ignored: {', '.join(conv.ignored)}")
    if conv.approximated:
        parts.append(f"approximated: {'; '.join(conv.approximated)}")
    return f"warning: {'; '.join(parts)}" if parts else None


def _scalar(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9).strip()
    return text.removesuffix("...").strip()


def recipe_yaml(conv: Conversion, recipe_dict: dict, source: str) -> str:
    """The recipe (as Recipe.to_dict()) as YAML, every field commented with where it came from."""
    lines = [
        f"# dtensor3d recipe converted from the nanotron config {source}",
        "# (python -m dtensor3d convert-nanotron)",
    ]
    for section, values in recipe_dict.items():
        lines.append(f"{section}:")
        for key, value in values.items():
            why = conv.sources.get(f"{section}.{key}", "dtensor3d's default (no nanotron key)")
            lines.append(f"  {key}: {_scalar(value)}  # {why}")
    return "\n".join(lines) + "\n"


def warn(conv: Conversion) -> None:
    """Print the warning line once per job (rank 0, or outside torchrun)."""
    line = warning_line(conv)
    if line and is_rank0():
        print(line, file=sys.stderr, flush=True)
