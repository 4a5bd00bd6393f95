"""Door checks of multi-token prediction (model.num_nextn_predict_layers, models/mtp.py)."""

from __future__ import annotations

from ..errors import RecipeError


def validate_mtp(recipe) -> None:
    """A negative depth or weight and a depth that leaves no target in the window: each one
    RecipeError line naming the key, the value and what is valid. MTP runs at every mesh and
    schedule, a tied embedding under a V schedule included (parallel/tied.py's `copies`)."""
    m, seq = recipe.model, recipe.training.sequence_length
    depth = m.num_nextn_predict_layers
    if depth < 0:
        raise RecipeError(f"model.num_nextn_predict_layers={depth} must be >= 0 (0: no multi-token prediction)")
    if m.mtp_loss_weight < 0:
        raise RecipeError(f"model.mtp_loss_weight={m.mtp_loss_weight} must be >= 0")
    if depth and depth >= seq:
        raise RecipeError(
            f"model.num_nextn_predict_layers={depth}: depth k predicts the token k+1 ahead, so it must be below "
            f"training.sequence_length={seq}; valid: 0 to {seq - 1}"
        )
