"""Door checks of multi-token prediction (model.num_nextn_predict_layers, models/mtp.py)."""

from __future__ import annotations

from ..errors import RecipeError


def validate_mtp(recipe) -> None:
    """A negative depth or weight and a depth that leaves no target in the window: each one
    RecipeError line naming the key, the value and what is valid. MTP runs at every mesh but
    one: a tied embedding under a V schedule (zbv, dualpipev), whose first and last stage share
    a rank, trains wrong gradients (grad_norm 11% off one process at pp 2 zbv, 2026-12-05;
    1f1b and untied V schedules are exact), so it is refused until that is fixed."""
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
    p = recipe.parallelism
    if depth and m.tie_word_embeddings and p.pp > 1 and p.pp_engine in ("zbv", "dualpipev"):
        raise RecipeError(
            f"model.num_nextn_predict_layers={depth} with model.tie_word_embeddings=true and "
            f"parallelism.pp_engine={p.pp_engine}: the V schedules' shared first/last-stage rank does not yet sum "
            "the tied embedding's MTP copy right; use pp_engine 1f1b or interleaved_1f1b, or untied embeddings"
        )
