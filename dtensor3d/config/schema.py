"""Recipes: YAML -> frozen dataclasses, checked before any process group starts.

A recipe has seven sections. Every check that can be made from the recipe and the world
size lives here, as pure functions that raise `RecipeError` with one line naming the key,
the bad value and what would be valid. This module must not import torch: `launch.sh`
validates with it before torchrun starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from ..errors import RecipeError
from . import nanotron
from .families import ACTIVATIONS, FAMILIES, rope_problem


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    num_local_experts: int = 0  # 0: dense feed-forward (no experts); Mixtral's names below
    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.001
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    moe_layers: tuple[int, ...] | None = None  # None: every layer has experts
    # Model families (config/families.py) and Hugging Face's switches, by their config.json names.
    family: str = "llama"  # llama | qwen2 | qwen3 | mistral | mixtral
    head_dim: int | None = None  # None: hidden_size / num_attention_heads
    attention_bias: bool = False  # biases on q, k, v and o
    mlp_bias: bool = False  # biases on gate, up and down
    rope_scaling: dict | None = None  # HF's rope_scaling / rope_parameters: rope_type llama3 | linear | yarn
    sliding_window: int | None = None  # None: full attention (a window must cover the sequence)
    hidden_act: str = "silu"

    def __post_init__(self):
        if self.head_dim is None and self.num_attention_heads > 0 and self.hidden_size % self.num_attention_heads == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias or FAMILIES[self.family].qkv_bias

    @property
    def qk_norm(self) -> bool:
        return FAMILIES[self.family].qk_norm

    def is_moe_layer(self, index: int) -> bool:
        """Layers with experts: all of them when the model has experts, unless moe_layers lists some."""
        return bool(self.num_local_experts) and (self.moe_layers is None or index in self.moe_layers)


def stage_layers(num_layers: int, pp: int, pp_layers: tuple[int, ...] | None = None) -> list[range]:
    """The global decoder layer indices of each pipeline stage: `pp_layers` if given, else
    balanced by count with earlier stages taking the remainder."""
    counts = list(pp_layers) if pp_layers else [num_layers // pp + (i < num_layers % pp) for i in range(pp)]
    starts = [sum(counts[:i]) for i in range(pp)]
    return [range(s, s + c) for s, c in zip(starts, counts)]


V_SCHEDULES = ("zbv", "dualpipev")  # two stages per rank, placed in a V (rank r: stages r and 2*pp-1-r)


@dataclass(frozen=True)
class ParallelismConfig:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    pp_engine: str = "1f1b"
    pp_layers: tuple[int, ...] | None = None
    tp_mode: str = "ALL_REDUCE"
    tp_linear_async_communication: bool = False
    recompute_layer: bool = False
    dp_mode: str = "shard"
    dp_shard: int = 0  # dp_mode hybrid: dp ranks per FSDP group (replicated over dp / dp_shard); 0: unset
    pp_virtual_stages: int = 0  # stages per rank; 0: the schedule's own (2: interleaved_1f1b, zbv, dualpipev)
    recompute: str | None = None  # none | full | selective; None: recompute_layer's (true: full)

    def __post_init__(self):
        if self.recompute is None:  # nanotron's recompute_layer: true keeps meaning full
            object.__setattr__(self, "recompute", "full" if self.recompute_layer else "none")

    @property
    def dims(self) -> dict[str, int]:
        """Mesh axis sizes in nanotron's order: ep, pp, dp, cp, tp (tp fastest)."""
        return {"ep": self.ep, "pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}

    @property
    def world_size(self) -> int:
        return math.prod(self.dims.values())

    # Named facts about the mesh: every other file asks these instead of re-deriving them.
    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def dp_cp(self) -> int:
        """Ranks that hold the same parameters and different tokens (FSDP's dense group size / ep)."""
        return self.dp * self.cp

    @property
    def batch_ranks(self) -> int:
        """Ranks that split the global batch by samples: ep x dp."""
        return self.ep * self.dp

    def batch_rank(self, coords: dict[str, int]) -> int:
        """This rank's index among the `batch_ranks` (ep-major, as in the rank matrix)."""
        return coords["ep"] * self.dp + coords["dp"]

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 shards parameters over ep x dp x cp (dense) and dp x cp (experts); under
        dp_mode hybrid over ep x dp_shard x cp and dp_shard x cp, replicated over dp_replicate."""
        return self.dp_mode in ("shard", "hybrid") and self.ep * self.dp_cp > 1

    @property
    def hsdp_enabled(self) -> bool:
        """dp_mode hybrid: FSDP within groups of dp_shard dp ranks, replicated across them."""
        return self.dp_mode == "hybrid"

    @property
    def dp_replicate(self) -> int:
        """HSDP's replica count: dp / dp_shard (1 unless dp_mode is hybrid)."""
        return self.dp // self.dp_shard if self.hsdp_enabled and self.dp_shard else 1

    @property
    def replicate_enabled(self) -> bool:
        """Gradients are all-reduced over ep x dp x cp (dense) and dp x cp (experts)."""
        return self.dp_mode == "replicate" and self.ep * self.dp_cp > 1

    @property
    def fsdp_reshard_after_forward(self) -> bool:
        """A pipeline stage keeps its parameters gathered between a microbatch's forward and backward."""
        return not self.pp_enabled

    @property
    def sequence_parallel(self) -> bool:
        return self.tp_mode == "REDUCE_SCATTER"

    @property
    def loss_parallel(self) -> bool:
        """Logits stay sharded on the vocabulary over tp; the loss is computed on the shards."""
        return self.tp_enabled

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each pp rank holds: 2 for the V schedules (zbv, dualpipev), pp_virtual_stages
        (default 2) for interleaved_1f1b, 1 otherwise."""
        if self.pp_engine in V_SCHEDULES:
            return 2
        if self.pp_engine == "interleaved_1f1b":
            return self.pp_virtual_stages or 2
        return 1

    @property
    def pp_stages(self) -> int:
        """Pipeline stages in all: pp ranks x stages_per_rank."""
        return self.pp * self.stages_per_rank

    @property
    def sequence_divisor(self) -> int:
        """sequence_length must be a multiple of this: 2*cp zig-zag chunks, and tp*cp under
        sequence parallelism."""
        divisor = 2 * self.cp if self.cp_enabled else 1
        return math.lcm(divisor, self.tp * self.cp) if self.sequence_parallel else divisor


@dataclass(frozen=True)
class TrainingConfig:
    steps: int = 10
    seed: int = 42
    sequence_length: int = 64
    global_batch_size: int = 8
    micro_batch_size: int = 1
    dtype: str = "float32"
    device: str = "auto"
    eval_every: int = 0  # steps between validation losses (and at the last step); 0: never
    eval_batches: int = 1  # global batches of validation windows per evaluation
    on_nonfinite: str = "stop"  # a NaN/inf loss or gradient: stop (one error line) | skip the update
    max_skipped_steps: int = 10  # on_nonfinite=skip: stop after this many consecutive skipped steps
    timeout_s: float = 600.0  # a collective that does not complete in this time ends the run
    compile: bool = False  # torch.compile each decoder block (in place; parameter names unchanged)


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0
    decay: str = "cosine"
    min_lr: float = 0.0


@dataclass(frozen=True)
class DataConfig:
    kind: str = "synthetic"
    path: str | None = None  # tokens: a prepared directory (prepare-data) or one .npy / .bin token file
    seed: int | None = None  # the sample order's seed (null: training.seed)
    validation: str | None = "split"  # validation windows: "split" (data.path's own), a prepared directory, or null


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None
    interval: int = 0  # 0: save only at the end (when dir is set)
    resume: str = "auto"  # auto (newest complete in dir) | none | a step or checkpoint directory
    keep: int = 2
    init_from_hf: str | None = None  # a Hugging Face Llama directory to start from (no resume)
    preempt_timeout_s: float = 120.0  # SIGTERM/SIGINT: stop, save and exit within this time
    async_save: bool = False  # `async: true`: write checkpoints in the background while training goes on


@dataclass(frozen=True)
class LoggingConfig:
    run_dir: str = "runs/default"
    every: int = 1
    tensorboard: bool = False  # TensorBoard events in <run_dir>/tensorboard (the `tensorboard` extra)
    profile_steps: tuple[int, ...] | None = None  # [first, last]: a torch.profiler trace per rank of those steps
    layout: bool = False  # <run_dir>/layout/rank<R>.json: how each rank holds every parameter


@dataclass(frozen=True)
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def num_microbatches(self) -> int:
        """Microbatches per optimizer step on each of the ep x dp batch ranks."""
        p, t = self.parallelism, self.training
        return t.global_batch_size // (t.micro_batch_size * p.batch_ranks)

    def to_dict(self) -> dict[str, Any]:
        """Every setting as plain YAML types, less those that cannot apply (the expert settings
        of a dense model), so that the dict read back as a recipe is accepted."""
        out = dataclasses.asdict(self)
        if not self.model.num_local_experts:
            for key in EXPERT_ONLY:
                del out["model"][key]
        for section in out.values():
            for key, value in section.items():
                if isinstance(value, tuple):
                    section[key] = list(value)
        return out


SECTIONS = {f.name: f.type for f in dataclasses.fields(Recipe)}
_SECTION_CLASSES = {
    "model": ModelConfig,
    "parallelism": ParallelismConfig,
    "training": TrainingConfig,
    "optimizer": OptimizerConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
}
# nanotron's long names for the short ones we keep.
ALIASES = {
    ("parallelism", "context_parallel_size"): "cp",
    ("parallelism", "expert_parallel_size"): "ep",
    ("checkpoint", "async"): "async_save",  # `async` is a Python keyword
}
ENUMS = {
    ("model", "family"): tuple(FAMILIES),
    ("model", "hidden_act"): ACTIVATIONS,
    ("parallelism", "pp_engine"): ("1f1b", "afab", "interleaved_1f1b", "zbv", "dualpipev"),
    ("parallelism", "recompute"): ("none", "full", "selective"),
    ("parallelism", "tp_mode"): ("ALL_REDUCE", "REDUCE_SCATTER"),
    ("parallelism", "dp_mode"): ("shard", "replicate", "hybrid"),
    ("training", "dtype"): ("float32", "bfloat16"),
    ("training", "device"): ("auto", "cpu", "cuda"),
    ("optimizer", "decay"): ("cosine", "linear", "constant"),
    ("data", "kind"): ("synthetic", "tokens"),
    ("training", "on_nonfinite"): ("stop", "skip"),
}
NON_EMPTY = {
    "logging.run_dir": "a directory path, e.g. runs/debug",
    "checkpoint.resume": "auto, none, or a step or checkpoint directory",
}
POSITIVE = {
    "model": (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
    ),
    "parallelism": ("dp", "tp", "pp", "cp", "ep"),
    "training": ("steps", "sequence_length", "global_batch_size", "micro_batch_size", "eval_batches"),
    "checkpoint": ("keep",),
    "logging": ("every",),
}


def _fail(msg: str) -> RecipeError:
    return RecipeError(msg)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _coerce(where: str, value: Any, annotation: str) -> Any:
    """Check one value against its field's annotation; return it in canonical form."""
    ann = annotation.replace(" ", "")
    optional = ann.endswith("|None")
    ann = ann.removesuffix("|None")
    if (value is None or value == "") and optional:  # an empty value unsets an optional field
        return None
    if ann == "int" and isinstance(value, int) and not isinstance(value, bool):
        return value
    if ann == "float" and not isinstance(value, bool):
        number = None
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads 3e-4 as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise _fail(f"{where}={value!r} must be a finite number")
            return number
    if ann == "bool" and isinstance(value, bool):
        return value
    if ann == "str" and isinstance(value, str):
        return value
    if ann == "dict" and isinstance(value, dict):
        return {str(k): v for k, v in value.items()}
    if ann == "tuple[float,float]" and isinstance(value, (list, tuple)) and len(value) == 2:
        return tuple(_coerce(where, v, "float") for v in value)
    if ann == "tuple[int,...]" and isinstance(value, (list, tuple)):
        return tuple(_coerce(where, v, "int") for v in value)
    raise _wrong_type(where, value, ann, optional)


def _wrong_type(where: str, value: Any, ann: str, optional: bool) -> RecipeError:
    """The one line for a value of the wrong type (an empty value and a non-integer number
    each get their own words: YAML 1.1 reads `1e9` as a string)."""
    expected = {
        "tuple[float,float]": "a list of two numbers",
        "tuple[int,...]": "a list of integers",
        "dict": "a mapping",
    }
    want = expected.get(ann, ann) + (" or null" if optional else "")
    if value == "":
        return _fail(f"{where}='' is the empty string; expected {want}")
    number = _as_number(value)
    if ann == "int" and number is not None:
        hint = f", e.g. {int(number)}" if math.isfinite(number) and number.is_integer() else ""
        return _fail(f"{where}={value} must be an integer (expected int{hint})")
    return _fail(f"{where}={value!r} has type {_type_name(value)}; expected {want}")


def _as_number(value: Any) -> float | None:
    """A float, or a string that reads as a number in YAML 1.2 (`1e9`, `3.5`); else None."""
    if isinstance(value, float):
        return value
    if isinstance(value, str) and value.strip() and not value.strip().lstrip("+-").isdigit():
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _suggest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"{hint}valid: {', '.join(valid)}"


def _build_section(name: str, raw: Any) -> Any:
    cls = _SECTION_CLASSES[name]
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise _fail(f"{name}={raw!r} must be a mapping of keys to values")
    types = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    valid = sorted(list(types) + [alias for (s, alias) in ALIASES if s == name])
    values: dict[str, Any] = {}
    spelled: dict[str, str] = {}  # canonical name -> the spelling the recipe used
    for key, value in raw.items():
        key = str(key)
        canon = ALIASES.get((name, key), key)
        if canon not in types:
            raise _fail(f"{name}.{key}: unknown key; {_suggest(key, valid)}")
        where = f"{name}.{key}"
        value = _coerce(where, value, types[canon])
        if (name, canon) in ENUMS and value is not None:
            choices = ENUMS[(name, canon)]
            match = [c for c in choices if c.lower() == value.lower()]
            if not match:
                raise _fail(f"{where}={value!r} is not a valid choice; valid: {', '.join(choices)}")
            value = match[0]
        elif value == "":  # a non-optional string that is no choice: run_dir, resume
            raise _fail(f"{where}='' is the empty string; expected {NON_EMPTY.get(where, 'a non-empty str')}")
        if canon in values and values[canon] != value:
            raise _fail(
                f"{where}={value!r} conflicts with {name}.{spelled[canon]}={values[canon]!r} "
                f"(aliases of one setting); give one of them"
            )
        values[canon] = value
        spelled[canon] = key
    return cls(**values)


def parse_override(text: str) -> tuple[list[str], Any]:
    """'parallelism.tp=4' -> (['parallelism', 'tp'], 4); the value is read as a YAML scalar."""
    if "=" not in text:
        raise _fail(f"override {text!r} has no '='; expected key.path=value, e.g. parallelism.tp=2")
    path, _, raw = text.partition("=")
    keys = path.strip().split(".")
    if len(keys) != 2 or not all(keys):
        raise _fail(f"override {text!r}: key {path!r} must be section.key, e.g. training.steps=20")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""  # `key=`: the empty string (unsets an optional key)
    except yaml.YAMLError:
        raise _fail(f"override {text!r}: value {raw!r} is not a YAML scalar") from None
    return keys, value


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: str) -> dict[str, Any]:
    if os.path.isdir(path):
        raise _fail(f"recipe {path!r} is a directory; pass the path of a YAML recipe, e.g. recipes/3d.yaml")
    if not os.path.isfile(path):
        raise _fail(f"recipe {path!r}: no such file; pass the path of a YAML recipe, e.g. recipes/3d.yaml")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise _fail(f"recipe {path!r} is not UTF-8 text (byte {e.start}); pass a YAML recipe") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise _fail(f"recipe {path!r}{line}: YAML error: {problem}") from None
    if raw is None:
        raise _fail(f"recipe {path!r} is empty; expected sections {', '.join(SECTIONS)}")
    if not isinstance(raw, dict):
        raise _fail(f"recipe {path!r} must be a mapping of sections ({', '.join(SECTIONS)}), not {_type_name(raw)}")
    return raw


def recipe_from_dict(raw: dict[str, Any], overrides: list[str] | tuple[str, ...] = (), strict: bool = False) -> Recipe:
    """A Recipe from a YAML mapping and key.path=value overrides. `strict` (a user's recipe, not
    a saved record): settings given that cannot apply to this model are refused too."""
    raw = {str(k): v for k, v in raw.items()}
    for section in raw:
        if section not in SECTIONS:
            raise _fail(f"{section}: unknown section; {_suggest(section, list(SECTIONS))}")
    raw = _apply_overrides(raw, overrides)
    recipe = Recipe(**{name: _build_section(name, raw.get(name)) for name in SECTIONS})
    if strict:
        _check_applicable(raw, recipe)
    return recipe


def _apply_overrides(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """raw with each override set; a key given twice on the command line is refused, as in a file."""
    given: dict[tuple[str, str], tuple[str, Any]] = {}  # (section, canonical key) -> (override, value)
    for text in overrides:
        (section, key), value = parse_override(text)
        if section not in SECTIONS:
            raise _fail(f"override {text!r}: unknown section {section!r}; {_suggest(section, list(SECTIONS))}")
        canon = ALIASES.get((section, key), key)
        if (section, canon) in given:
            before, old = given[(section, canon)]
            if before.partition("=")[0].strip() == f"{section}.{key}":
                raise _fail(f"override {text!r}: {section}.{key} is given twice on the command line; give it once")
            if old != value:
                raise _fail(f"override {text!r} conflicts with {before!r} (aliases of one setting); give one of them")
        given[(section, canon)] = (text, value)
        body = raw.get(section)
        body = dict(body) if isinstance(body, dict) else {}
        # An override of an alias replaces whichever spelling the file used.
        for (s, alias), target in ALIASES.items():
            if s == section and target == canon:
                body.pop(alias, None)
        body.pop(canon, None)
        body[key] = value
        raw[section] = body
    return raw


# Model settings that only a mixture of experts uses (model.num_local_experts > 0).
EXPERT_ONLY = ("num_experts_per_tok", "router_aux_loss_coef", "shared_expert_intermediate_size")


def _check_applicable(raw: dict[str, Any], recipe: Recipe) -> None:
    """Settings the recipe or an override gave that cannot apply (their defaults are not refused)."""
    model = raw.get("model") or {}
    if recipe.model.num_local_experts == 0:
        given = [f"model.{k}={model[k]}" for k in EXPERT_ONLY if k in model]
        if given:
            raise _fail(
                f"{', '.join(given)}: expert settings on a dense model (model.num_local_experts=0) cannot "
                f"apply; remove them, or set num_local_experts > 0 for a mixture of experts"
            )


def load_recipe(path: str, overrides: list[str] | tuple[str, ...] = (), world_size: int | None = None) -> Recipe:
    """Read, override and validate a recipe (or a nanotron config, mapped by nanotron.py).
    Raises RecipeError with one line."""
    raw = _read_yaml(path)
    if nanotron.is_nanotron(raw):
        recipe, conv = _from_nanotron(raw, overrides)
        nanotron.warn(conv)
    else:
        recipe = recipe_from_dict(raw, overrides, strict=True)
    validate(recipe, world_size)
    return recipe


def _from_nanotron(raw: dict[str, Any], overrides) -> tuple[Recipe, nanotron.Conversion]:
    conv = nanotron.convert(raw, overrides)
    return recipe_from_dict(conv.fields, conv.recipe_overrides, strict=True), conv


def load_nanotron(path: str, overrides: list[str] | tuple[str, ...] = ()) -> tuple[Recipe, nanotron.Conversion]:
    """`convert-nanotron`: a nanotron config file -> its validated recipe and how each field mapped."""
    raw = _read_yaml(path)
    if not nanotron.is_nanotron(raw):
        raise _fail(
            f"{path} is not a nanotron config (no model.model_config, and not two of the sections "
            f"{', '.join(nanotron.NANOTRON_SECTIONS)}); it is a recipe already"
        )
    recipe, conv = _from_nanotron(raw, overrides)
    validate(recipe)
    return recipe, conv


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def validate(recipe: Recipe, world_size: int | None = None) -> None:
    """Every cross-field check that needs only the recipe and the world size."""
    m, p, o = recipe.model, recipe.parallelism, recipe.optimizer
    for section, keys in POSITIVE.items():
        for key in keys:
            value = getattr(getattr(recipe, section), key)
            if value <= 0:
                raise _fail(f"{section}.{key}={value} must be a positive integer")
    if world_size is not None and p.world_size != world_size:
        sizes = "*".join(f"{v}" for v in p.dims.values())
        raise _fail(
            f"parallelism: ep*pp*dp*cp*tp = {sizes} = {p.world_size} but the world size is "
            f"{world_size}; choose sizes whose product is {world_size}"
        )
    _validate_model(m, p)
    _validate_stages(m, p)
    _validate_batch(recipe)
    _validate_schedule(recipe)
    _validate_optimizer(o)
    _validate_rest(recipe)
    _validate_family(recipe)


def _validate_family(recipe: Recipe) -> None:
    """What a family turns on, its RoPE scaling and its sliding window."""
    m, seq = recipe.model, recipe.training.sequence_length
    if FAMILIES[m.family].experts != bool(m.num_local_experts) and m.family != "llama":
        raise _fail(
            f"model.family={m.family!r} with num_local_experts={m.num_local_experts}: experts come with "
            f"family 'mixtral' (or 'llama' with num_local_experts > 0), none with the others"
        )
    if m.head_dim <= 0 or m.head_dim % 2:
        raise _fail(f"model.head_dim={m.head_dim} must be a positive even number (RoPE rotates pairs)")
    for key in ("attention_bias", "mlp_bias"):
        if getattr(m, key) and key not in FAMILIES[m.family].biases:
            with_it = [name for name, f in FAMILIES.items() if key in f.biases]
            raise _fail(
                f"model.{key}=true: family {m.family!r} has no such switch; families with it: {', '.join(with_it)}"
            )
    problem = rope_problem(m.rope_scaling)
    if problem:
        raise _fail(f"model.rope_scaling: {problem}")
    if m.sliding_window is not None and m.sliding_window < seq:
        raise _fail(
            f"model.sliding_window={m.sliding_window} is smaller than training.sequence_length={seq}: "
            f"sliding-window attention is not supported; use null or a window >= the sequence length"
        )


def _validate_model(m: ModelConfig, p: ParallelismConfig) -> None:
    """Model shapes, and their divisibility by tp."""
    if m.num_attention_heads % p.tp:
        raise _fail(
            f"parallelism.tp={p.tp}: model.num_attention_heads={m.num_attention_heads} is not "
            f"divisible by tp; valid tp: {_divisors(math.gcd(m.num_attention_heads, m.num_key_value_heads))}"
        )
    if m.num_key_value_heads % p.tp:
        raise _fail(
            f"parallelism.tp={p.tp}: model.num_key_value_heads={m.num_key_value_heads} is not "
            f"divisible by tp; valid tp: {_divisors(m.num_key_value_heads)}"
        )
    if m.head_dim is None:
        raise _fail(
            f"model.hidden_size={m.hidden_size} is not divisible by num_attention_heads="
            f"{m.num_attention_heads}; choose a multiple of {m.num_attention_heads}"
        )
    if m.num_attention_heads % m.num_key_value_heads:
        raise _fail(
            f"model.num_key_value_heads={m.num_key_value_heads} does not divide num_attention_heads="
            f"{m.num_attention_heads}; valid: {_divisors(m.num_attention_heads)}"
        )
    _validate_experts(m)
    if m.rms_norm_eps <= 0 or m.rope_theta <= 0:
        raise _fail(f"model.rms_norm_eps={m.rms_norm_eps}, rope_theta={m.rope_theta}: both must be > 0")
    if m.intermediate_size % p.tp:
        raise _fail(f"parallelism.tp={p.tp}: model.intermediate_size={m.intermediate_size} is not divisible by tp")
    if m.vocab_size % p.tp:
        raise _fail(
            f"parallelism.tp={p.tp}: model.vocab_size={m.vocab_size} is not divisible by tp; "
            f"pad the vocabulary to a multiple of {p.tp}"
        )


def _validate_experts(m: ModelConfig) -> None:
    if m.num_local_experts < 0:
        raise _fail(f"model.num_local_experts={m.num_local_experts} must be >= 0 (0: no experts)")
    if m.num_local_experts and not 1 <= m.num_experts_per_tok <= m.num_local_experts:
        raise _fail(
            f"model.num_experts_per_tok={m.num_experts_per_tok} must be in 1..num_local_experts={m.num_local_experts}"
        )
    if m.router_aux_loss_coef < 0 or m.shared_expert_intermediate_size < 0:
        raise _fail(
            f"model.router_aux_loss_coef={m.router_aux_loss_coef}, shared_expert_intermediate_size="
            f"{m.shared_expert_intermediate_size}: both must be >= 0"
        )
    if m.moe_layers is not None and (
        not m.num_local_experts or any(not 0 <= i < m.num_hidden_layers for i in m.moe_layers)
    ):
        raise _fail(
            f"model.moe_layers={list(m.moe_layers)} must list layer indices in 0.."
            f"{m.num_hidden_layers - 1} of a model with experts (num_local_experts > 0)"
        )


def _validate_stages(m: ModelConfig, p: ParallelismConfig) -> None:
    """Layers against pipeline stages; experts against ep."""
    if m.num_hidden_layers < p.pp:
        raise _fail(
            f"parallelism.pp={p.pp}: model.num_hidden_layers={m.num_hidden_layers} is fewer than "
            f"the pipeline stages; valid pp: 1..{m.num_hidden_layers}"
        )
    if p.pp_layers is not None:
        if len(p.pp_layers) != p.pp or sum(p.pp_layers) != m.num_hidden_layers or min(p.pp_layers) < 1:
            raise _fail(
                f"parallelism.pp_layers={list(p.pp_layers)} must be {p.pp} positive layer counts "
                f"summing to num_hidden_layers={m.num_hidden_layers}"
            )
    if m.tie_word_embeddings and p.pp > 1:
        raise _fail(
            f"model.tie_word_embeddings=true with parallelism.pp={p.pp}: the embedding and the head "
            f"live on different stages; use tie_word_embeddings: false or pp: 1"
        )
    if p.ep > 1 and m.num_local_experts == 0:
        raise _fail(f"parallelism.ep={p.ep}: the model has no experts (model.num_local_experts=0); valid ep: 1")
    if p.ep > 1 and m.num_local_experts % p.ep:
        raise _fail(
            f"parallelism.ep={p.ep}: model.num_local_experts={m.num_local_experts} is not "
            f"divisible by ep; valid ep: {_divisors(m.num_local_experts)}"
        )


def _validate_batch(recipe: Recipe) -> None:
    """The global batch against microbatches and ranks; the sequence against cp and tp."""
    m, p, t = recipe.model, recipe.parallelism, recipe.training
    per_step = t.micro_batch_size * p.dp * p.ep
    if t.global_batch_size % per_step:
        raise _fail(
            f"training.global_batch_size={t.global_batch_size} is not divisible by "
            f"micro_batch_size*dp*ep = {t.micro_batch_size}*{p.dp}*{p.ep} = {per_step}; "
            f"use a multiple of {per_step}"
        )
    if p.pp > 1 and p.pp_engine == "1f1b" and recipe.num_microbatches < p.pp:
        raise _fail(
            f"training.global_batch_size={t.global_batch_size} gives {recipe.num_microbatches} "
            f"microbatches, fewer than pp={p.pp} under pp_engine 1f1b; use global_batch_size >= "
            f"{p.pp * per_step}"
        )
    if p.cp > 1 and t.sequence_length % (2 * p.cp):
        raise _fail(
            f"training.sequence_length={t.sequence_length} is not divisible by 2*cp = {2 * p.cp}; "
            f"use a multiple of {2 * p.cp}"
        )
    if p.tp_mode == "REDUCE_SCATTER" and t.sequence_length % (p.tp * p.cp):
        raise _fail(
            f"training.sequence_length={t.sequence_length} is not divisible by tp*cp = "
            f"{p.tp * p.cp} under tp_mode REDUCE_SCATTER; use a multiple of {p.tp * p.cp}"
        )
    if t.sequence_length > m.max_position_embeddings:
        raise _fail(
            f"training.sequence_length={t.sequence_length} exceeds model.max_position_embeddings="
            f"{m.max_position_embeddings}"
        )


def _validate_schedule(recipe: Recipe) -> None:
    """Stages per rank, layers per stage and microbatch counts the pipeline schedule can take;
    recompute against nanotron's recompute_layer."""
    m, p, n = recipe.model, recipe.parallelism, recipe.num_microbatches
    if p.recompute_layer and p.recompute != "full":
        raise _fail(f"parallelism.recompute={p.recompute} conflicts with recompute_layer=true (which means full)")
    v = p.pp_virtual_stages
    if p.pp_engine == "interleaved_1f1b":
        ok, valid_v = v == 0 or v >= 2, "0 (default 2) or 2 and more"
    elif p.pp_engine in V_SCHEDULES:
        ok, valid_v = v in (0, 2), "0 or 2 (a V of two stages per rank)"
    else:
        ok, valid_v = v in (0, 1), "0 or 1 (one stage per rank)"
    if not ok:
        raise _fail(f"parallelism.pp_virtual_stages={v} does not fit pp_engine {p.pp_engine}; valid: {valid_v}")
    if p.pp_enabled and p.pp_engine in V_SCHEDULES and p.recompute == "selective":
        # Their split backward (input gradients, then weight gradients) recomputes each layer
        # twice; torch's selective checkpoint lets a region's saved outputs be used only once.
        raise _fail(
            f"parallelism.recompute=selective does not work with pp_engine {p.pp_engine} (its split "
            "backward recomputes each layer twice, which selective checkpointing refuses); valid: none or full"
        )
    if not p.pp_enabled or p.stages_per_rank == 1:
        return
    stages = p.pp_stages
    if p.pp_layers is not None:
        raise _fail(f"parallelism.pp_layers applies to one stage per rank; pp_engine {p.pp_engine} balances layers")
    if m.num_hidden_layers % stages:
        valid = [k for k in range(2, m.num_hidden_layers + 1) if m.num_hidden_layers % (p.pp * k) == 0]
        raise _fail(
            f"model.num_hidden_layers={m.num_hidden_layers} is not divisible into pp*stages_per_rank = "
            f"{p.pp}*{p.stages_per_rank} = {stages} stages under pp_engine {p.pp_engine}; valid stages per rank: "
            f"{', '.join(map(str, valid)) or 'none (use pp_engine 1f1b)'}"
        )
    if not _micro_ok(p, n):
        valid = [k for k in range(1, 8 * p.pp_stages + 1) if _micro_ok(p, k)][:6]
        raise _fail(
            f"training.global_batch_size={recipe.training.global_batch_size} gives {n} microbatches per rank, "
            f"which pp_engine {p.pp_engine} at pp={p.pp} cannot take; valid microbatch counts: "
            f"{', '.join(map(str, valid))}, ... (global_batch_size = count * micro_batch_size * dp * ep)"
        )


def _micro_ok(p: ParallelismConfig, n: int) -> bool:
    """Microbatch counts the multi-stage schedules take: at least pp (dualpipev: every stage),
    and for interleaved_1f1b a multiple of its rounds (n // pp)."""
    if n < (p.pp_stages if p.pp_engine == "dualpipev" else p.pp):
        return False
    return p.pp_engine != "interleaved_1f1b" or n % max(1, n // p.pp) == 0


def _validate_optimizer(o: OptimizerConfig) -> None:
    if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
        raise _fail(f"optimizer.lr={o.lr}, min_lr={o.min_lr}: need lr > 0 and 0 <= min_lr <= lr")
    if o.warmup_steps < 0 or o.clip_grad < 0 or o.weight_decay < 0 or o.eps <= 0:
        raise _fail(
            "optimizer: warmup_steps, clip_grad and weight_decay must be >= 0 and eps > 0 "
            f"(got {o.warmup_steps}, {o.clip_grad}, {o.weight_decay}, {o.eps})"
        )
    if not all(0.0 <= b < 1.0 for b in o.betas):
        raise _fail(f"optimizer.betas={list(o.betas)}: each beta must be in [0, 1)")


def _validate_rest(recipe: Recipe) -> None:
    """Data, logging, the seed, checkpoints and evaluation."""
    if recipe.data.kind == "tokens" and not recipe.data.path:
        raise _fail("data.path is required with data.kind 'tokens'; give the path of a token file")
    if recipe.data.kind == "synthetic" and recipe.data.path:
        raise _fail(
            f"data.path={recipe.data.path!r} is given but data.kind is 'synthetic', which reads no file; "
            "set data.kind: tokens to train on it, or drop data.path"
        )
    _validate_logging(recipe)
    _validate_seed(recipe.training.seed)
    if recipe.checkpoint.interval < 0:
        raise _fail(f"checkpoint.interval={recipe.checkpoint.interval} must be >= 0 (0: only at the end)")
    _validate_hybrid(recipe.parallelism)
    if recipe.training.eval_every < 0:
        raise _fail(f"training.eval_every={recipe.training.eval_every} must be >= 0 (0: never evaluate)")
    _validate_faults(recipe)


def _validate_faults(recipe: Recipe) -> None:
    t, c = recipe.training, recipe.checkpoint
    if t.max_skipped_steps < 1:
        raise _fail(f"training.max_skipped_steps={t.max_skipped_steps} must be a positive integer")
    for where, value in (("training.timeout_s", t.timeout_s), ("checkpoint.preempt_timeout_s", c.preempt_timeout_s)):
        if value <= 0:
            raise _fail(f"{where}={value:g} must be a positive number of seconds")


# torch.manual_seed takes 64 bits, but per-sample seeds are derived from it (seed * 1_000_003 + i
# in datasets/sources.py); 32 bits keep those within range, as numpy's seeds are.
SEED_MAX = 2**32 - 1


def _validate_seed(seed: int) -> None:
    if not 0 <= seed <= SEED_MAX:
        raise _fail(f"training.seed={seed} is out of range; valid: 0..{SEED_MAX} (2**32-1)")


def _validate_logging(recipe: Recipe) -> None:
    lg, steps = recipe.logging, recipe.training.steps
    if lg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise _fail(
            "logging.tensorboard=true needs the tensorboard package; pip install 'dtensor3d[tensorboard]' "
            "or set logging.tensorboard: false"
        )
    if lg.profile_steps is not None and (
        len(lg.profile_steps) != 2 or not 1 <= lg.profile_steps[0] <= lg.profile_steps[1] <= steps
    ):
        raise _fail(
            f"logging.profile_steps={list(lg.profile_steps)} must be [first, last] with "
            f"1 <= first <= last <= training.steps={steps}"
        )


def _validate_hybrid(p: ParallelismConfig) -> None:
    """dp_shard goes with dp_mode hybrid, and divides dp."""
    if p.dp_mode != "hybrid":
        if p.dp_shard:
            raise _fail(
                f"parallelism.dp_shard={p.dp_shard} applies only with dp_mode: hybrid (dp_mode is {p.dp_mode}); "
                f"remove it or set dp_mode: hybrid"
            )
        return
    if not p.dp_shard or p.dp % p.dp_shard:
        raise _fail(
            f"parallelism.dp_shard={p.dp_shard} with dp_mode hybrid must divide dp={p.dp} "
            f"(FSDP within groups of dp_shard ranks, replicated across them); valid: {_divisors(p.dp)}"
        )
