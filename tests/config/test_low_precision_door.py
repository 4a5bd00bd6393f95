"""The door of training.float8 and optimizer.state_dtype (config/low_precision.py): each
mistake is one error: line naming the key, the value and what is valid."""

import pytest
from helpers import PARITY, cli, one_error_line

from dtensor3d.config.load import load_recipe
from dtensor3d.errors import RecipeError
from dtensor3d.plan.float8_door import check_float8_gather
from dtensor3d.plan.state_bytes import check_blocks

BF16 = "training.dtype=bfloat16"


@pytest.mark.parametrize(
    "given, words",
    [
        (["training.float8={recipe: tensorwise}"], "training.float8 with training.dtype=float32"),
        ([BF16, "training.float8={recipe: blockwise}"], "training.float8.recipe='blockwise'"),
        ([BF16, "training.float8={recipe: rowwise, fsdp_all_gather: true}"], "recipe=rowwise with"),
        ([BF16, "training.float8={recipes: rowwise}"], "training.float8.recipes: no such key"),
        ([BF16, "training.float8={fsdp_all_gather: maybe}"], "fsdp_all_gather='maybe'"),
        (
            [BF16, "training.float8={recipe: tensorwise}", "parallelism.tp=2"]
            + ["parallelism.tp_linear_async_communication=true"],
            "training.float8 with parallelism.tp_linear_async_communication=true",
        ),
    ],
)
def test_float8_mistakes_are_refused(given, words):
    with pytest.raises(RecipeError, match=None) as caught:
        load_recipe(PARITY, given)
    assert words in str(caught.value), str(caught.value)


def test_float8_valid_values_pass():
    for given in ("{recipe: tensorwise}", "{recipe: rowwise}", "{recipe: tensorwise, fsdp_all_gather: false}", "{}"):
        recipe = load_recipe(PARITY, [BF16, f"training.float8={given}"])
        assert recipe.training.float8 is not None


def test_float8_without_bf16_is_one_error_line():
    line = one_error_line(cli("validate", PARITY, "training.float8={recipe: rowwise}"))
    assert "training.float8 with training.dtype=float32" in line and "bfloat16" in line, line


@pytest.mark.parametrize("value", ["bfloat16", "8bit"])
def test_low_precision_states_pass_the_door(value):
    """Meshes whose shards are whole 256-element blocks (or any mesh, for bf16)."""
    wide = ["model.hidden_size=512", "model.intermediate_size=1024"]  # o_proj / down_proj tp shards 256, 512 wide
    for mesh in ([], [*wide, "parallelism.tp=2"], ["parallelism.dp=2", "parallelism.dp_mode=shard"]):
        recipe = load_recipe(PARITY, [f"optimizer.state_dtype={value}", *mesh])
        assert recipe.optimizer.state_dtype == value and check_blocks(recipe) is None
    if value == "bfloat16":
        assert check_blocks(load_recipe(PARITY, ["optimizer.state_dtype=bfloat16", "parallelism.tp=2"])) is None


@pytest.mark.parametrize(
    "mesh, words",
    [
        (["parallelism.tp=2"], "with parallelism.tp=2: model.layers.0.self_attn.o_proj.weight's row-parallel shards"),
        (["parallelism.dp=3", "training.global_batch_size=3"], "with FSDP over 3 ranks: model.embed_tokens.weight's"),
    ],
)
def test_8bit_where_blocks_would_be_cut_is_one_error_line(mesh, words):
    """torchao's step takes every placement (config/low_precision.py), but a shard that is not
    whole blocks would keep fp32 moments where one process keeps 8-bit ones: refused."""
    line = one_error_line(cli("validate", PARITY, "optimizer.state_dtype=8bit", *mesh))
    assert "optimizer.state_dtype=8bit " + words in line and "state_dtype: bfloat16" in line, line


def test_unknown_state_dtype_is_one_error_line():
    line = one_error_line(cli("validate", PARITY, "optimizer.state_dtype=float16"))
    assert "optimizer.state_dtype" in line and "8bit" in line, line


def test_float8_all_gather_needs_even_fsdp_shards():
    """dp 3 on the parity model: the layers' 64-row weights do not split over 3, and FSDP2's
    float8 all-gather of uneven float8 shards fails (gloo aborts the process: measured); the
    door refuses it, while fsdp_all_gather: false, rowwise, or hidden 96 (rows 96 / 192) pass."""
    dp3 = [BF16, "parallelism.dp=3", "training.global_batch_size=3"]
    with pytest.raises(RecipeError) as caught:
        check_float8_gather(load_recipe(PARITY, [*dp3, "training.float8={recipe: tensorwise}"]))
    assert "FSDP over 3 ranks: model.layers.0.self_attn.q_proj.weight's 64 rows" in str(caught.value)
    assert "fsdp_all_gather: false" in str(caught.value)
    for fine in (
        ["training.float8={recipe: tensorwise, fsdp_all_gather: false}"],
        ["training.float8={recipe: rowwise}"],
        ["training.float8={recipe: tensorwise}", "model.hidden_size=96", "model.intermediate_size=192"],
    ):
        assert check_float8_gather(load_recipe(PARITY, [*dp3, *fine])) is None
