"""nanotron configs: a nanotron YAML config (general, parallelism, model, tokens, optimizer,
checkpoints, data_stages, logging, tokenizer, profiler) read field by field onto a Recipe.

Every key of the config is one of: mapped (copied or computed onto a recipe field, the
source named in `convert-nanotron`'s comments), ignored (no effect on the maths here: one
warning line lists them), approximated (mapped to the nearest thing dtensor3d has: named in
the same warning) or refused (a value that would change the maths and that dtensor3d cannot
honour: one `error:` line names them all). The tables of keys, reading a config into its
leaves and the overrides' two spellings are in nanotron_keys.py; this module maps the leaves
onto recipe fields (`convert`) and writes the converted recipe. Never imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import yaml

from ..errors import RecipeError
from .nanotron_data import data_fields
from .nanotron_keys import (
    APPROXIMATED,
    DIRECT,
    IGNORED,
    REFUSED,
    REQUIRED,
    Refusal,
    flatten,
    recipe_key,
    schema_path,
    set_path,
    split_overrides,
)


# Top-level sections only a nanotron config has (a recipe has `checkpoint`, nanotron `checkpoints`).
class _Reader:
    """Reads a flattened config with nanotron's defaults; `value` None counts as unset."""

    def __init__(self, flat: dict[str, Any]):
        self.flat = flat
        self.notes: list[str] = []  # "key=value (what dtensor3d does)": the warning line's approximations

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
        raise Refusal("model.dtype", dtype, "valid: bfloat16 (autocast), float32")
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
        raise Refusal("optimizer.zero_stage", zero, "valid: 0 (replicated), 1 (sharded)")
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
    """nanotron's LambdaLR: linear warmup, hold at learning_rate until lr_decay_starting_step
    (null: warmup's end), cosine / linear / 1-sqrt decay over lr_decay_steps (null: to the last
    step), then min_decay_lr: optimizer.decay_start, decay_steps, decay and min_lr."""
    s = "optimizer.learning_rate_scheduler"
    lr, warmup = r.get(f"{s}.learning_rate", REQUIRED), r.get(f"{s}.lr_warmup_steps", 0)
    if r.get(f"{s}.lr_warmup_style", "linear") != "linear" and warmup:
        raise Refusal(f"{s}.lr_warmup_style", r.get(f"{s}.lr_warmup_style"), "warmup is linear")
    style = r.get(f"{s}.lr_decay_style", "linear")
    if style not in ("cosine", "linear", "1-sqrt"):
        raise Refusal(f"{s}.lr_decay_style", style, "valid: cosine, linear, 1-sqrt")
    start, decay = r.get(f"{s}.lr_decay_starting_step"), r.get(f"{s}.lr_decay_steps")
    if start is not None and not warmup <= start <= r.get("tokens.train_steps", REQUIRED):
        raise Refusal(f"{s}.lr_decay_starting_step", start, f"valid: lr_warmup_steps={warmup} to tokens.train_steps")
    if decay is not None and decay < 1:
        raise Refusal(f"{s}.lr_decay_steps", decay, "valid: >= 1")
    min_lr = r.get(f"{s}.min_decay_lr")
    return {
        "optimizer.decay": (style, f"{s}.lr_decay_style"),
        "optimizer.decay_start": (
            start,
            f"{s}.lr_decay_starting_step" + (" unset: warmup's end" if start is None else ""),
        ),
        "optimizer.decay_steps": (decay, f"{s}.lr_decay_steps" + (" unset: to the last step" if decay is None else "")),
        "optimizer.min_lr": (
            lr if min_lr is None else min_lr,
            f"{s}.min_decay_lr" + (" unset: learning_rate" if min_lr is None else ""),
        ),
    }


def _checkpoint(r: _Reader) -> Fields:
    resume = r.get("checkpoints.resume_checkpoint_path")
    if resume is not None:
        return {"checkpoint.resume": (str(resume), "checkpoints.resume_checkpoint_path")}
    if r.given("checkpoints.checkpoints_path"):
        why = "checkpoints.resume_checkpoint_path unset: auto, the newest complete checkpoint in checkpoint.dir"
        return {"checkpoint.resume": ("auto", why)}
    return {}


def _profiler(r: _Reader) -> Fields:
    """nanotron's torch.profiler schedule (skip_first, then wait, warmup, active steps) -> the
    1-based steps it records; dtensor3d writes the traces to <run_dir>/profile."""
    if not r.given("profiler.profiler_export_path"):
        return {}
    p = {k: r.get(f"profiler.{k}", d) for k, d in (("skip_first", 3), ("wait", 1), ("warmup", 1), ("active", 1))}
    first = p["skip_first"] + p["wait"] + p["warmup"] + 1
    last, steps = first + p["active"] - 1, r.get("tokens.train_steps", REQUIRED)
    if last > steps:  # profiling changes no maths: nanotron runs it and records what it reaches
        kept = "nothing is profiled" if first > steps else f"only steps {first}..{steps} are profiled"
        r.notes.append(f"profiler={p} (it profiles steps {first}..{last}, past tokens.train_steps={steps}: {kept})")
        if first > steps:
            return {}
        last = steps
    why = "profiler: steps skip_first + wait + warmup + 1 .. + active - 1 (repeat: once), traces in run_dir/profile"
    return {"logging.profile_steps": ([first, last], why)}


def _refusals(flat: dict[str, Any]) -> list[str]:
    out = []
    for path, value in flat.items():
        accepted, why = REFUSED.get(schema_path(path.split(".")), ((value,), ""))
        if value not in accepted:
            out.append(f"{path}={value!r} ({why})")
    return out


def _map(flat: dict[str, Any], skip: set[str]) -> tuple[Fields, list[str], list[str]]:
    """Every recipe field the config sets, every refusal and every approximation note (a mapping
    whose recipe fields are all given as recipe-spelled overrides (`skip`) is not read)."""
    r, fields, refused = _Reader(flat), {}, _refusals(flat)
    steps = {
        _direct: None,
        _model: None,
        _training: None,
        _optimizer: None,
        _checkpoint: None,
        _profiler: None,
        data_fields: {"data.kind", "data.path", "data.sources", "data.stages"},
    }
    for fn, produces in steps.items():
        if produces and produces & skip:
            continue
        try:
            fields.update(fn(r))
        except Refusal as e:
            refused.append(str(e))
    return fields, refused, r.notes


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
    raw = yaml.safe_load(yaml.safe_dump(raw, sort_keys=False))  # a deep copy the overrides may change, in file order
    for parts, value in nano:
        set_path(raw, parts, value, ".".join(parts))
    flat = flatten(raw)
    skip = {recipe_key(t.partition("=")[0].strip().split(".")) for t in recipe_over}
    fields, refused, notes = _map(flat, skip)
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
    sources |= {recipe_key(t.partition("=")[0].strip().split(".")): f"override {t}" for t in recipe_over}
    schema = {path: schema_path(path.split(".")) for path in flat}
    ignored = tuple(p for p in flat if schema[p] in IGNORED and flat[p] is not None)
    approx = tuple(f"{p}={flat[p]!r} ({APPROXIMATED[schema[p]]})" for p in flat if schema[p] in APPROXIMATED)
    approx += tuple(notes)
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
