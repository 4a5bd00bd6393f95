"""The checks that need the whole recipe and the world size (the door: before any process
group). Each raises one `RecipeError` line naming the key, the value and what is valid."""

from __future__ import annotations

import importlib.util
import math

from ..errors import RecipeError
from .data_sources import mixture_problem
from .eval_checks import validate_eval, validate_wandb
from .families import FAMILIES, rope_problem
from .low_precision import validate_low_precision
from .moe_checks import validate_experts, validate_mla
from .mtp_checks import validate_mtp
from .optim_checks import validate_decay, validate_optimizer
from .schema import POSITIVE, V_SCHEDULES, ModelConfig, ParallelismConfig, Recipe
from .stability_checks import validate_stability


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def validate(recipe: Recipe, world_size: int | None = None) -> None:
    """Every cross-field check that needs only the recipe and the world size."""
    m, p, o = recipe.model, recipe.parallelism, recipe.optimizer
    for section, keys in POSITIVE.items():
        for key in keys:
            value = getattr(getattr(recipe, section), key)
            if value is not None and value <= 0:  # null: the knob is off
                raise RecipeError(f"{section}.{key}={value} must be a positive integer")
    if world_size is not None and p.world_size != world_size:
        sizes = "*".join(f"{v}" for v in p.dims.values())
        raise RecipeError(
            f"parallelism: ep*pp*dp*cp*tp = {sizes} = {p.world_size} but the world size is "
            f"{world_size}; choose sizes whose product is {world_size}"
        )
    _validate_model(m, p)
    _validate_stages(m, p)
    _validate_batch(recipe)
    _validate_schedule(recipe)
    _validate_recompute(recipe)
    validate_optimizer(o)
    validate_decay(o, recipe.training.steps)
    _validate_rest(recipe)
    _validate_family(recipe)
    validate_mtp(recipe)
    validate_stability(recipe)
    validate_low_precision(recipe)
    validate_eval(recipe)
    validate_wandb(recipe)


def _validate_family(recipe: Recipe) -> None:
    """What a family turns on, its RoPE scaling and its sliding window (config/families.py)."""
    m = recipe.model
    if FAMILIES[m.family].experts != bool(m.num_local_experts) and m.family not in ("llama", "deepseek_v3", "glm4_moe"):
        raise RecipeError(
            f"model.family={m.family!r} with num_local_experts={m.num_local_experts}: experts come with "
            f"family 'mixtral' (or 'llama' or 'deepseek_v3' with num_local_experts > 0), none with the others"
        )
    if m.mla:
        validate_mla(m, recipe.parallelism)
    for key, field in (("use_qk_norm", "qk_norm_key"), ("nope_layers", "nope"), ("sliding_rope", "layer_rope")):
        if getattr(m, key) and not getattr(FAMILIES[m.family], field):
            _no_switch(m, key, field)
    if m.partial_rotary_factor != 1.0 and not FAMILIES[m.family].partial_rotary:
        _no_switch(m, "partial_rotary_factor", "partial_rotary")
    if m.head_dim <= 0 or m.head_dim % 2:
        raise RecipeError(f"model.head_dim={m.head_dim} must be a positive even number (RoPE rotates pairs)")
    if not 0 < m.partial_rotary_factor <= 1 or m.rotary_dim % 2:
        raise RecipeError(
            f"model.partial_rotary_factor={m.partial_rotary_factor}: must be in (0, 1] and give an even number of "
            f"rotated dims (head_dim {m.head_dim} x it = {m.head_dim * m.partial_rotary_factor:g})"
        )
    for key in ("attention_bias", "mlp_bias"):
        if getattr(m, key) and key not in FAMILIES[m.family].biases:
            with_it = ", ".join(name for name, f in FAMILIES.items() if key in f.biases)
            raise RecipeError(f"model.{key}=true: family {m.family!r} has no such switch; families with it: {with_it}")
    problem = rope_problem(m.rope_scaling)
    if problem:
        raise RecipeError(f"model.rope_scaling: {problem}")
    _validate_switches(m, recipe.parallelism)
    _validate_windows(m)


def _no_switch(m: ModelConfig, key: str, field: str) -> None:
    with_it = ", ".join(name for name, f in FAMILIES.items() if getattr(f, field))
    value = getattr(m, key)
    raise RecipeError(f"model.{key}={value!r}: family {m.family!r} has no such switch; families with it: {with_it}")


def _validate_windows(m: ModelConfig) -> None:
    """Sliding windows, per-layer types and the sliding layers' RoPE."""
    problem = rope_problem(m.sliding_rope)
    if problem:
        raise RecipeError(f"model.sliding_rope: {problem}")
    if m.sliding_window is not None and m.mla:
        raise RecipeError(
            f"model.sliding_window={m.sliding_window}: family {m.family!r} (latent attention) has no sliding window; "
            "use null"
        )
    if m.sliding_window is not None and m.sliding_window < 1:
        raise RecipeError(f"model.sliding_window={m.sliding_window} must be >= 1 (null: full attention)")
    types = ("sliding_attention", "full_attention")
    if m.layer_types is not None and (len(m.layer_types) != m.num_hidden_layers or set(m.layer_types) - set(types)):
        raise RecipeError(
            f"model.layer_types={list(m.layer_types)}: give one of {', '.join(types)} for each of the "
            f"num_hidden_layers={m.num_hidden_layers} layers (or null: every layer sliding_attention)"
        )


def _validate_switches(m: ModelConfig, p: ParallelismConfig) -> None:
    """NoPE layers (SmolLM3); norms after the sublayers (OLMo 2, Gemma 3) against sequence parallelism."""
    bad = [i for i in m.nope_layers or () if not 0 <= i < m.num_hidden_layers]
    if bad:
        last = m.num_hidden_layers - 1
        raise RecipeError(f"model.nope_layers={list(m.nope_layers)}: no layer {bad[0]}; valid: 0 to {last}")
    if (m.post_norms or m.sandwich_norms) and p.sequence_parallel:
        raise RecipeError(
            f"parallelism.tp_mode={p.tp_mode}: family {m.family!r} has norms after attention and the MLP, which "
            "sequence parallelism does not shard; use tp_mode: ALL_REDUCE"
        )
    if m.hidden_act != "silu" and m.num_local_experts:
        raise RecipeError(f"model.hidden_act={m.hidden_act!r}: experts are SwiGLU; use silu with num_local_experts > 0")


def _validate_model(m: ModelConfig, p: ParallelismConfig) -> None:
    """Model shapes, and their divisibility by tp."""
    if m.num_attention_heads % p.tp:
        raise RecipeError(
            f"parallelism.tp={p.tp}: model.num_attention_heads={m.num_attention_heads} is not "
            f"divisible by tp; valid tp: {_divisors(math.gcd(m.num_attention_heads, m.num_key_value_heads))}"
        )
    if m.num_key_value_heads % p.tp:
        raise RecipeError(
            f"parallelism.tp={p.tp}: model.num_key_value_heads={m.num_key_value_heads} is not "
            f"divisible by tp; valid tp: {_divisors(m.num_key_value_heads)}"
        )
    if m.head_dim is None:
        raise RecipeError(
            f"model.hidden_size={m.hidden_size} is not divisible by num_attention_heads="
            f"{m.num_attention_heads}; choose a multiple of {m.num_attention_heads}"
        )
    if m.num_attention_heads % m.num_key_value_heads:
        raise RecipeError(
            f"model.num_key_value_heads={m.num_key_value_heads} does not divide num_attention_heads="
            f"{m.num_attention_heads}; valid: {_divisors(m.num_attention_heads)}"
        )
    validate_experts(m)
    if m.rms_norm_eps <= 0 or m.rope_theta <= 0:
        raise RecipeError(f"model.rms_norm_eps={m.rms_norm_eps}, rope_theta={m.rope_theta}: both must be > 0")
    if m.intermediate_size % p.tp:
        raise RecipeError(
            f"parallelism.tp={p.tp}: model.intermediate_size={m.intermediate_size} is not divisible by tp"
        )
    if m.padded_vocab_size % p.tp:
        padded = f" (padded to {m.padded_vocab_size})" if m.pad_vocab_to_multiple_of else ""
        raise RecipeError(
            f"parallelism.tp={p.tp}: model.vocab_size={m.vocab_size}{padded} is not divisible by tp; "
            f"set model.pad_vocab_to_multiple_of to a multiple of {p.tp} (the padded logits never count)"
        )


def _validate_stages(m: ModelConfig, p: ParallelismConfig) -> None:
    """Layers against pipeline stages; experts against ep."""
    if m.num_hidden_layers < p.pp:
        raise RecipeError(
            f"parallelism.pp={p.pp}: model.num_hidden_layers={m.num_hidden_layers} is fewer than "
            f"the pipeline stages; valid pp: 1..{m.num_hidden_layers}"
        )
    if p.pp_layers is not None:
        if len(p.pp_layers) != p.pp or sum(p.pp_layers) != m.num_hidden_layers or min(p.pp_layers) < 1:
            raise RecipeError(
                f"parallelism.pp_layers={list(p.pp_layers)} must be {p.pp} positive layer counts "
                f"summing to num_hidden_layers={m.num_hidden_layers}"
            )
    if p.ep > 1 and m.num_local_experts == 0:
        raise RecipeError(f"parallelism.ep={p.ep}: the model has no experts (model.num_local_experts=0); valid ep: 1")
    if p.ep > 1 and m.num_local_experts % p.ep:
        raise RecipeError(
            f"parallelism.ep={p.ep}: model.num_local_experts={m.num_local_experts} is not "
            f"divisible by ep; valid ep: {_divisors(m.num_local_experts)}"
        )


def _validate_batch(recipe: Recipe) -> None:
    """The global batch against microbatches and ranks; the sequence against cp and tp."""
    m, p, t = recipe.model, recipe.parallelism, recipe.training
    per_step = t.micro_batch_size * p.dp * p.ep
    if t.global_batch_size % per_step:
        raise RecipeError(
            f"training.global_batch_size={t.global_batch_size} is not divisible by "
            f"micro_batch_size*dp*ep = {t.micro_batch_size}*{p.dp}*{p.ep} = {per_step}; "
            f"use a multiple of {per_step}"
        )
    if p.pp > 1 and p.pp_engine == "1f1b" and recipe.num_microbatches < p.pp:
        raise RecipeError(
            f"training.global_batch_size={t.global_batch_size} gives {recipe.num_microbatches} "
            f"microbatches, fewer than pp={p.pp} under pp_engine 1f1b; use global_batch_size >= "
            f"{p.pp * per_step}"
        )
    if p.cp > 1 and t.sequence_length % (2 * p.cp):
        raise RecipeError(
            f"training.sequence_length={t.sequence_length} is not divisible by 2*cp = {2 * p.cp}; "
            f"use a multiple of {2 * p.cp}"
        )
    if p.tp_mode == "REDUCE_SCATTER" and t.sequence_length % (p.tp * p.cp):
        raise RecipeError(
            f"training.sequence_length={t.sequence_length} is not divisible by tp*cp = "
            f"{p.tp * p.cp} under tp_mode REDUCE_SCATTER; use a multiple of {p.tp * p.cp}"
        )
    if t.sequence_length > m.max_position_embeddings:
        raise RecipeError(
            f"training.sequence_length={t.sequence_length} exceeds model.max_position_embeddings="
            f"{m.max_position_embeddings}"
        )


def _validate_recompute(recipe: Recipe) -> None:
    """torch.compile under the V schedules (see below), and selective recomputation of a
    layer with experts under torch.compile: the layer is checkpointed around its compiled
    attention (routing is not compiled), and the matmul outputs selective checkpointing
    saves are buffers inductor's code writes again, which torch detects in the backward
    ('Tensor cached during selective activation checkpoint has been mutated', every rank;
    found by tests/parallel/test_matrix.py)."""
    p, t = recipe.parallelism, recipe.training
    if t.compile and p.pp_enabled and p.pp_engine in V_SCHEDULES:
        # Their split backward keeps the graph for the weight gradients; a compiled backward
        # refuses that ('compiled with non-empty donated buffers'; found by the matrix).
        raise RecipeError(
            f"training.compile=true does not work with pp_engine {p.pp_engine} (its split backward "
            "reuses the graph a compiled backward frees); valid: compile: false, or pp_engine 1f1b, "
            "afab or interleaved_1f1b"
        )
    if p.recompute == "selective" and t.compile and recipe.model.num_local_experts:
        raise RecipeError(
            "parallelism.recompute=selective with training.compile=true does not work for a model with "
            "experts (the compiled attention overwrites the outputs it saves); valid: recompute none or "
            "full, or training.compile: false"
        )


def _validate_schedule(recipe: Recipe) -> None:
    """Stages per rank, layers per stage and microbatch counts the pipeline schedule can take;
    recompute against nanotron's recompute_layer."""
    m, p, n = recipe.model, recipe.parallelism, recipe.num_microbatches
    if p.recompute_layer and p.recompute != "full":
        raise RecipeError(f"parallelism.recompute={p.recompute} conflicts with recompute_layer=true (which means full)")
    v = p.pp_virtual_stages
    if p.pp_engine == "interleaved_1f1b":
        ok, valid_v = v == 0 or v >= 2, "0 (default 2) or 2 and more"
    elif p.pp_engine in V_SCHEDULES:
        ok, valid_v = v in (0, 2), "0 or 2 (a V of two stages per rank)"
    else:
        ok, valid_v = v in (0, 1), "0 or 1 (one stage per rank)"
    if not ok:
        raise RecipeError(f"parallelism.pp_virtual_stages={v} does not fit pp_engine {p.pp_engine}; valid: {valid_v}")
    if p.pp_enabled and p.pp_engine in V_SCHEDULES and p.recompute == "selective":
        # Their split backward (input gradients, then weight gradients) recomputes each layer
        # twice; torch's selective checkpoint lets a region's saved outputs be used only once.
        raise RecipeError(
            f"parallelism.recompute=selective does not work with pp_engine {p.pp_engine} (its split "
            "backward recomputes each layer twice, which selective checkpointing refuses); valid: none or full"
        )
    if not p.pp_enabled or p.stages_per_rank == 1:
        return
    stages = p.pp_stages
    if p.pp_layers is not None:
        raise RecipeError(
            f"parallelism.pp_layers applies to one stage per rank; pp_engine {p.pp_engine} balances layers"
        )
    if m.num_hidden_layers % stages:
        valid = [k for k in range(2, m.num_hidden_layers + 1) if m.num_hidden_layers % (p.pp * k) == 0]
        raise RecipeError(
            f"model.num_hidden_layers={m.num_hidden_layers} is not divisible into pp*stages_per_rank = "
            f"{p.pp}*{p.stages_per_rank} = {stages} stages under pp_engine {p.pp_engine}; valid stages per rank: "
            f"{', '.join(map(str, valid)) or 'none (use pp_engine 1f1b)'}"
        )
    if not _micro_ok(p, n):
        valid = [k for k in range(1, 8 * p.pp_stages + 1) if _micro_ok(p, k)][:6]
        raise RecipeError(
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


def _validate_rest(recipe: Recipe) -> None:
    """Data, logging, the seed, checkpoints and evaluation."""
    problem = mixture_problem(recipe.data)
    if problem:
        raise RecipeError(problem)
    if recipe.data.kind == "tokens" and not recipe.data.path and not recipe.data.sources and not recipe.data.stages:
        raise RecipeError(
            "data.path is required with data.kind 'tokens'; give the path of a token file or prepared directory "
            "(or data.sources)"
        )
    if recipe.data.kind == "synthetic" and recipe.data.path:
        raise RecipeError(
            f"data.path={recipe.data.path!r} is given but data.kind is 'synthetic', which reads no file; "
            "set data.kind: tokens to train on it, or drop data.path"
        )
    _validate_logging(recipe)
    _validate_seed(recipe.training.seed)
    if recipe.checkpoint.interval < 0:
        raise RecipeError(f"checkpoint.interval={recipe.checkpoint.interval} must be >= 0 (0: only at the end)")
    _validate_hybrid(recipe.parallelism)
    if recipe.training.eval_every < 0:
        raise RecipeError(f"training.eval_every={recipe.training.eval_every} must be >= 0 (0: never evaluate)")
    _validate_faults(recipe)


def _validate_faults(recipe: Recipe) -> None:
    t, c = recipe.training, recipe.checkpoint
    if t.max_skipped_steps < 1:
        raise RecipeError(f"training.max_skipped_steps={t.max_skipped_steps} must be a positive integer")
    for where, value in (("training.timeout_s", t.timeout_s), ("checkpoint.preempt_timeout_s", c.preempt_timeout_s)):
        if value <= 0:
            raise RecipeError(f"{where}={value:g} must be a positive number of seconds")
    if not 0 < t.memory_fraction <= 1:
        raise RecipeError(f"training.memory_fraction={t.memory_fraction:g} must be a share in (0, 1], e.g. 0.9")


# torch.manual_seed takes 64 bits, but per-sample seeds are derived from it (seed * 1_000_003 + i
# in datasets/sources.py); 32 bits keep those within range, as numpy's seeds are.
SEED_MAX = 2**32 - 1


def _validate_seed(seed: int) -> None:
    if not 0 <= seed <= SEED_MAX:
        raise RecipeError(f"training.seed={seed} is out of range; valid: 0..{SEED_MAX} (2**32-1)")


def _validate_logging(recipe: Recipe) -> None:
    lg, steps = recipe.logging, recipe.training.steps
    if lg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise RecipeError(
            "logging.tensorboard=true needs the tensorboard package; pip install 'dtensor3d[tensorboard]' "
            "or set logging.tensorboard: false"
        )
    if lg.profile_steps is not None and (
        len(lg.profile_steps) != 2 or not 1 <= lg.profile_steps[0] <= lg.profile_steps[1] <= steps
    ):
        raise RecipeError(
            f"logging.profile_steps={list(lg.profile_steps)} must be [first, last] with "
            f"1 <= first <= last <= training.steps={steps}"
        )


def _validate_hybrid(p: ParallelismConfig) -> None:
    """dp_shard goes with dp_mode hybrid, and divides dp; a pipeline stage keeps its
    parameters gathered for the step (torch's schedules do), so `always` is not for pp."""
    if p.pp_enabled and p.fsdp_reshard_after_forward == "always":
        raise RecipeError(
            "parallelism.fsdp_reshard_after_forward=always does not work with pp > 1 (a pipeline stage keeps "
            "its parameters gathered for the step); valid: default or never"
        )
    if p.dp_mode != "hybrid":
        if p.dp_shard:
            raise RecipeError(
                f"parallelism.dp_shard={p.dp_shard} applies only with dp_mode: hybrid (dp_mode is {p.dp_mode}); "
                f"remove it or set dp_mode: hybrid"
            )
        return
    if not p.dp_shard or p.dp % p.dp_shard:
        raise RecipeError(
            f"parallelism.dp_shard={p.dp_shard} with dp_mode hybrid must divide dp={p.dp} "
            f"(FSDP within groups of dp_shard ranks, replicated across them); valid: {_divisors(p.dp)}"
        )
