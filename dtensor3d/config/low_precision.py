"""Door checks and named facts of low precision: training.float8 (torchao's float8 training)
and optimizer.state_dtype (AdamW's moments in bf16 or 8 bits). Torch-free.

optimizer.state_dtype: 8bit. torchao's step holds every placement dtensor3d builds (tried on 2
ranks: Shard(0), Shard(1), Replicate and FSDP-over-tp's _StridedShard: each step matches the
one-process step bitwise). What it cannot hold is a parameter whose 256-element blocks a mesh
cuts across: a row-parallel tp shard narrower than a block, an FSDP chunk that is not whole
blocks. Its moments would stay fp32 there (training/optim_lowp.py's blocks_align) while one
process keeps them in 8 bits, so the door refuses that pair (plan/state_bytes.py's check_blocks,
called by `validate` and `train` with the other checks that need the model's shapes)."""

from __future__ import annotations

import importlib.util

from ..errors import RecipeError

FLOAT8_RECIPES = ("tensorwise", "rowwise")  # torchao's Float8LinearRecipeName values we run
FLOAT8_KEYS = ("recipe", "fsdp_all_gather")


def float8_recipe(training) -> str | None:
    """The float8 recipe (tensorwise | rowwise), or None when training.float8 is off."""
    f8 = training.float8
    return None if f8 is None else f8.get("recipe", "tensorwise")


def float8_all_gather(training, parallelism) -> bool:
    """Whether FSDP2 gathers float8 weights: tensorwise (torchao gathers only tensorwise-scaled
    weights) under dp shard, unless fsdp_all_gather: false."""
    if float8_recipe(training) != "tensorwise" or not parallelism.fsdp_enabled:
        return False
    return bool(training.float8.get("fsdp_all_gather", True))


def validate_low_precision(recipe) -> None:
    """training.float8's keys and values and the pairs it cannot run with; optimizer.state_dtype's
    optimizer: each one RecipeError line naming the key, the value and what is valid."""
    t, p = recipe.training, recipe.parallelism
    if t.float8 is not None:
        _validate_float8(t.float8, t.dtype)
        if p.tp_linear_async_communication and p.tp > 1:
            raise RecipeError(
                "training.float8 with parallelism.tp_linear_async_communication=true: the chunked overlap computes "
                "the projections in its own matmuls, not torchao's float8 ones; set one of them off"
            )
    state = recipe.optimizer.state_dtype
    if state != "float32" and importlib.util.find_spec("torchao") is None:  # training/optim_lowp.py
        raise RecipeError(f"optimizer.state_dtype={state}: needs torchao (pip install torchao); float32 does not")


def _validate_float8(f8: dict, dtype: str) -> None:
    unknown = sorted(set(f8) - set(FLOAT8_KEYS))
    if unknown:
        raise RecipeError(f"training.float8.{unknown[0]}: no such key; valid keys: {', '.join(FLOAT8_KEYS)}")
    recipe = f8.get("recipe", "tensorwise")
    if recipe not in FLOAT8_RECIPES:
        raise RecipeError(f"training.float8.recipe={recipe!r}: not a float8 recipe; valid: {', '.join(FLOAT8_RECIPES)}")
    gather = f8.get("fsdp_all_gather", True)
    if not isinstance(gather, bool):
        raise RecipeError(f"training.float8.fsdp_all_gather={gather!r}: expected true or false")
    if gather and recipe == "rowwise" and "fsdp_all_gather" in f8:
        raise RecipeError(
            "training.float8.recipe=rowwise with training.float8.fsdp_all_gather=true: torchao gathers float8 "
            "weights only under tensorwise scaling; use recipe: tensorwise or fsdp_all_gather: false"
        )
    if dtype != "bfloat16":
        raise RecipeError(f"training.float8 with training.dtype={dtype}: float8 training needs dtype: bfloat16")
    if importlib.util.find_spec("torchao") is None:
        raise RecipeError("training.float8: needs torchao (pip install torchao); null: off")


def float8_weight(name: str, shape: tuple[int, ...]) -> bool:
    """Whether parameter `name` (whole shape `shape`) is a weight training.float8 converts: a
    decoder block's linear (not the router's gate, not the stacked experts), both dims divisible
    by 16 (parallel/float8.py's `convertible`, on parameter names for the torch-free plan)."""
    if not (name.startswith("model.layers.") and name.endswith(".weight") and len(shape) == 2):
        return False
    return not name.endswith(".gate.weight") and shape[0] % 16 == 0 and shape[1] % 16 == 0
