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


def _follow(advice: str, recipe, steps: int):
    """The recipe with the advice's optimizer.* overrides applied, run for `steps`."""
    import dataclasses
    import re

    given = {key: int(value) for key, value in re.findall(r"optimizer\.(\w+)=(\d+)", advice)}
    assert set(given) == {"decay_start", "decay_steps"}, advice
    return dataclasses.replace(recipe.optimizer, **given)


@pytest.mark.parametrize("decay", ("cosine", "linear", "1-sqrt"))
@pytest.mark.parametrize("start, length, step", [(60, 20, 30), (None, 20, 30), (60, 20, 70), (None, None, 50)])
def test_grown_steps_advice_keeps_the_lr_without_a_jump(decay, start, length, step):
    """A WSD run saved at `step` of 80, resumed with training.steps=120: following the note's
    advice, the resumed lr at every step up to the old run's end equals the saved curve (stable
    phase: the same decay shifted to the new end, same values over it)."""
    from dtensor3d.config.lr import keep_curve_advice

    old = _recipe(80, decay=decay, warmup_steps=10, decay_start=start, decay_steps=length)
    saved = {"decay_start": start, "decay_steps": length}
    advice = keep_curve_advice(old.optimizer, saved, 80, 120, step)
    new = _follow(advice, old, 120)
    validate(recipe_from_dict({"training": {"steps": 120}, "optimizer": dataclasses_dict(new)}))
    old_start = 10 if start is None else start
    old_len = 80 - old_start if length is None else length
    if step < old_start:  # stable until the new start, then the saved decay's values
        assert "extend the stable phase" in advice
        assert all(lr_at(s, new, 120) == 1e-3 for s in range(step, new.decay_start + 1))
        shift = new.decay_start - old_start
        for s in range(old_start, old_start + old_len):
            assert lr_at(s + shift, new, 120) == lr_at(s, old.optimizer, 80)
    else:  # already decaying: the saved curve, then min_lr
        assert "keep the saved run's curve" in advice
        assert [lr_at(s, new, 120) for s in range(step, 80)] == [lr_at(s, old.optimizer, 80) for s in range(step, 80)]
        assert lr_at(119, new, 120) == 1e-4


@pytest.mark.parametrize("saved_steps", (10, 80))
def test_grown_steps_advice_in_warmup_keeps_the_saved_shape(saved_steps):
    """Issue 43 item 16: a run saved at step 5, still in its 20-step warmup (default decay), then
    grown to 120 steps: the advice sets nothing (not decay_start=20 decay_steps=1, a one-step drop
    to min_lr, nor a stable phase the saved schedule never had), and the recomputed schedule keeps
    the saved shape: the same warmup, then the decay straight down to min_lr at the last step."""
    from dtensor3d.config.lr import keep_curve_advice

    old = _recipe(saved_steps, warmup_steps=20)
    advice = keep_curve_advice(old.optimizer, {"decay_start": None, "decay_steps": None}, saved_steps, 120, 5)
    assert "nothing to set" in advice and "optimizer.decay_start=" not in advice, advice
    new = old.optimizer  # the advice: keep the defaults
    assert [lr_at(s, new, 120) for s in range(5, 20)] == [lr_at(s, old.optimizer, saved_steps) for s in range(5, 20)]
    after = [lr_at(s, new, 120) for s in range(20, 120)]
    assert after[0] == 1e-3 and all(a > b for a, b in zip(after, after[1:])) and after[-1] > 1e-4


def dataclasses_dict(opt) -> dict:
    import dataclasses

    d = dataclasses.asdict(opt)
    d["betas"] = list(d["betas"])
    return d


def test_decay_past_the_last_step_is_said_in_one_warning_line():
    """validate (a real process): exit 0, stdout the world size, stderr one warning line naming
    the decay's end and training.steps; the defaults (decay to the last step) warn nothing."""
    from helpers import PARITY, cli_process

    proc = cli_process("validate", PARITY, "optimizer.decay_start=6", "optimizer.decay_steps=8")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: "), proc.stderr
    assert "ends the decay at step 14, past training.steps=10" in lines[0], lines[0]
    proc = cli_process("validate", PARITY, "optimizer.decay_start=6", "optimizer.decay_steps=4")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
