"""The learning-rate schedule (config/lr.py) against the formula written apart from it in
tests/helpers.py: every decay style, warmup-stable-decay boundaries, a decay shorter than the
run, and the door checks on decay_start / decay_steps. In-process, no training."""

from __future__ import annotations

import itertools

import pytest
from helpers import scheduled_lr

from dtensor3d.config.checks import validate
from dtensor3d.config.load import recipe_from_dict
from dtensor3d.config.lr import lr_at
from dtensor3d.errors import RecipeError

STYLES = ("cosine", "linear", "1-sqrt", "constant")


def _recipe(steps: int, **opt):
    return recipe_from_dict({"training": {"steps": steps}, "optimizer": {"lr": 1e-3, "min_lr": 1e-4, **opt}})


@pytest.mark.parametrize("decay", STYLES)
def test_every_step_matches_the_formula(decay):
    steps = 40
    cases = itertools.product((0, 5), (None, 5, 12, 39, 40), (None, 1, 7, 35, 100))
    checked = 0
    for warmup, start, length in cases:
        if start is not None and start < warmup:
            continue
        recipe = _recipe(steps, decay=decay, warmup_steps=warmup, decay_start=start, decay_steps=length)
        validate(recipe)
        for step in range(steps):
            got, want = lr_at(step, recipe.optimizer, steps), scheduled_lr(step, recipe.optimizer, steps)
            assert got == pytest.approx(want, rel=1e-12, abs=1e-18), (warmup, start, length, step)
            checked += 1
    assert checked > 1000


def test_wsd_boundaries():
    """warmup 4, stable until 10, linear decay over 5, then min_lr: values at each edge."""
    opt = _recipe(20, decay="linear", warmup_steps=4, decay_start=10, decay_steps=5).optimizer
    lrs = [lr_at(step, opt, 20) for step in range(20)]
    assert lrs[3] == 1e-3 and lrs[0] == pytest.approx(2.5e-4)
    assert lrs[4:11] == [1e-3] * 7  # stable through the decay's first step (progress 0)
    assert lrs[12] == pytest.approx(1e-3 - 0.4 * 9e-4)
    assert lrs[15:] == [1e-4] * 5  # held at min_lr after decay_steps
    sqrt = _recipe(20, decay="1-sqrt", warmup_steps=4, decay_start=10, decay_steps=4).optimizer
    assert lr_at(11, sqrt, 20) == pytest.approx(1e-3 - 0.5 * 9e-4)  # 1 - sqrt(1/4)


@pytest.mark.parametrize(
    "opt, words",
    [
        ({"warmup_steps": 5, "decay_start": 3}, ["optimizer.decay_start=3", "warmup_steps=5"]),
        ({"decay_start": -1}, ["optimizer.decay_start=-1"]),
        ({"decay_start": 21}, ["optimizer.decay_start=21", "training.steps=20"]),
        ({"decay_steps": 0}, ["optimizer.decay_steps=0", ">= 1"]),
        ({"decay_steps": -3}, ["optimizer.decay_steps=-3"]),
    ],
)
def test_door_refuses_inconsistent_values(opt, words):
    with pytest.raises(RecipeError) as err:
        validate(_recipe(20, **opt))
    line = str(err.value)
    assert "\n" not in line and all(word in line for word in words), line


def test_decay_past_the_last_step_is_allowed():
    """decay_start + decay_steps beyond training.steps: the run stops part-way down the decay."""
    recipe = _recipe(20, decay="linear", decay_start=10, decay_steps=20)
    validate(recipe)
    assert lr_at(19, recipe.optimizer, 20) == pytest.approx(1e-3 - 0.45 * 9e-4)
