"""The door's checks of training.float8 that need the model's shapes (called by `validate`
and `train` in __main__ beside plan/state_bytes.check_blocks; config may not import plan).
Pure Python."""

from __future__ import annotations

from ..config.low_precision import float8_all_gather
from ..errors import RecipeError
from .params import param_table


def check_float8_gather(recipe) -> None:
    """The door of FSDP2's float8 all-gather (training.float8 tensorwise, fsdp_all_gather on):
    each converted weight's rows must split evenly over its FSDP group. Where they do not,
    torchao's float8 shards of the ranks differ in size and the all-gather fails (measured at
    dp 3 on the parity model, gloo: "Received data size doesn't match expected size", the
    process aborted; with hidden 96, rows 96 / 192, it runs, the embedding's 256 rows uneven
    beside it). One RecipeError naming the first such weight."""
    if not float8_all_gather(recipe.training, recipe.parallelism):
        return
    for weight, row in param_table(recipe).items():
        if row.get("float8") and row["shape"][0] % row["group"]:
            raise RecipeError(
                f"training.float8 tensorwise with fsdp_all_gather and FSDP over {row['group']} ranks: {weight}'s "
                f"{row['shape'][0]} rows do not split evenly, and the float8 all-gather needs even shards; valid: "
                "an FSDP group size dividing every converted weight's rows, or training.float8.fsdp_all_gather: false"
            )
