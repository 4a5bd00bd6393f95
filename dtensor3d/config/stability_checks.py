"""Door checks of the training-stability guards: training.z_loss (training/zloss.py) and
training.skip_spikes (training/skip.py)."""

from __future__ import annotations

import math

from ..errors import RecipeError

SKIP_SPIKES_KEYS = ("window", "sigma")
SKIP_SPIKES_DEFAULTS = {"window": 100, "sigma": 6.0}


def skip_spikes_settings(training) -> tuple[int, float] | None:
    """(window, sigma) of training.skip_spikes, the defaults filling absent keys; None: off."""
    if training.skip_spikes is None:
        return None
    s = {**SKIP_SPIKES_DEFAULTS, **training.skip_spikes}
    return int(s["window"]), float(s["sigma"])


def validate_stability(recipe) -> None:
    """A negative or non-finite z_loss, an unknown skip_spikes key, a window below 2 (a standard
    deviation needs two steps) and a sigma not > 0: each one RecipeError line naming the key,
    the value and what is valid."""
    t = recipe.training
    z = t.z_loss
    if isinstance(z, bool) or not isinstance(z, (int, float)) or not math.isfinite(z) or z < 0:
        raise RecipeError(f"training.z_loss={z!r} must be a number >= 0 (1e-4 is PaLM's and OLMo's; 0: off)")
    if t.skip_spikes is None:
        return
    if not isinstance(t.skip_spikes, dict):
        raise RecipeError(f"training.skip_spikes={t.skip_spikes!r}: expected {{window: 100, sigma: 6.0}} or null (off)")
    unknown = sorted(set(t.skip_spikes) - set(SKIP_SPIKES_KEYS))
    if unknown:
        raise RecipeError(f"training.skip_spikes.{unknown[0]}: no such key; valid keys: window, sigma")
    window = t.skip_spikes.get("window", SKIP_SPIKES_DEFAULTS["window"])
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise RecipeError(
            f"training.skip_spikes.window={window!r} must be an integer >= 2 (the applied steps whose mean and "
            "standard deviation a step is compared with; 100 by default)"
        )
    sigma = t.skip_spikes.get("sigma", SKIP_SPIKES_DEFAULTS["sigma"])
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not math.isfinite(sigma) or sigma <= 0:
        raise RecipeError(
            f"training.skip_spikes.sigma={sigma!r} must be a number > 0 (standard deviations above the window's "
            "mean; 6.0 by default)"
        )
