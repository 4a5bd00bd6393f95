"""The combination matrix (tests/parallel/matrix.py): a pairwise covering array of every
parallelism and training option, each run a parity run against the 1-process run of the same
model (relative <= 1e-5 per step for loss, grad_norm, val_loss and the aux loss; tokens per
expert equal; compiled runs 1e-4, bf16 runs BF16_TOL), with the placement and byte checks of
the hand-written parity runs. The quick tests check the array itself: every pair that can run
is in a run, and every run passes the door.

`pytest -m matrix` runs every run; the full tier runs a rotating subset (conftest.py: the seed
is printed in the header; MATRIX_SEED / MATRIX_RUNS choose it)."""

import itertools

import pytest
from helpers import COMPILE_TOL, MOE, PARITY, assert_parity, check_comm, check_layout, scheduled_lrs, train_metrics
from matrix import (
    OPTIONS,
    RULES,
    allowed,
    as_run,
    covering,
    feasible,
    name,
    overrides,
    pairs_of,
    reference_overrides,
    world,
)

from dtensor3d.config.load import load_recipe
from dtensor3d.errors import RecipeError

SEED = 0  # the covering array's seed (a different seed: another array, as good)
RUNS = covering(SEED)
# bf16 against the 1-process bf16 run: both round to 8 mantissa bits, in other orders and at
# other points (FSDP2's cast of the gathered weights vs autocast's of each matmul's inputs).
# The bars of tests/models/test_reference.py's two bf16 implementations; measured here:
# qwen3 dp2 replicate x tp2 sequence parallel x pp2 1f1b, loss 4e-5, grad_norm 1.2e-3.
BF16_TOL = {"loss": 2e-4, "grad_norm": 3e-3, "aux_loss": 3e-3}


def recipe_of(run: dict[str, str]) -> str:
    return MOE if run["model"] == "moe" else PARITY


def test_every_pair_is_covered():
    """Each pair of values (option a = x, option b = y) that some allowed combination holds is
    in a run: counted from the runs' names and values, apart from the generator's bookkeeping."""
    rows = feasible()
    want = {
        (OPTIONS[a].name, run[OPTIONS[a].name], OPTIONS[b].name, run[OPTIONS[b].name])
        for run in map(as_run, rows)
        for a, b in itertools.combinations(range(len(OPTIONS)), 2)
    }
    chosen = {
        (OPTIONS[a].name, run[OPTIONS[a].name], OPTIONS[b].name, run[OPTIONS[b].name])
        for run in RUNS
        for a, b in itertools.combinations(range(len(OPTIONS)), 2)
    }
    assert len(want) == len(pairs_of(rows))
    assert want <= chosen, sorted(want - chosen)[:5]
    # Every value of every option is in some run (no value the rules make impossible).
    for option in OPTIONS:
        assert {run[option.name] for run in RUNS} == set(option.values), option.name
    assert covering(SEED) == RUNS  # stable for a seed
    assert all(allowed(run) for run in RUNS)
    print(f"matrix: {len(OPTIONS)} options, {len(rows)} allowed combinations, {len(want)} pairs, {len(RUNS)} runs")


@pytest.mark.parametrize("run", RUNS, ids=name)
def test_each_run_passes_the_door(run):
    recipe = load_recipe(recipe_of(run), overrides(run))
    assert recipe.parallelism.world_size == world(run) <= 8
    assert recipe_of(run) == PARITY or recipe.model.num_local_experts > 0


@pytest.mark.parametrize("rule", [r for r in RULES if r.door], ids=lambda r: r.why)
def test_the_door_refuses_what_a_rule_refuses(rule):
    """For each rule the trainer enforces: an allowed combination (the matrix's runs first)
    with one option changed so that this rule alone fails is refused at the door (the
    table's rules are the trainer's)."""
    for run in itertools.chain(RUNS, map(as_run, feasible())):
        for option in OPTIONS:
            for value in option.values:
                bad = {**run, option.name: value}
                if [r for r in RULES if not r.ok(bad)] == [rule]:
                    with pytest.raises(RecipeError):
                        load_recipe(recipe_of(bad), overrides(bad))
                    return
    pytest.fail(f"no run one option away breaks only {rule.why!r}")


def tolerance(run: dict[str, str]) -> float | dict[str, float]:
    if run["dtype"] == "bfloat16":
        return BF16_TOL
    return COMPILE_TOL if run["compile"] == "compiled" else 1e-5


@pytest.mark.matrix
@pytest.mark.parametrize("run", RUNS, ids=name)
def test_matrix_parity(run, reference, tmp_path, record_property):
    recipe_path, given = recipe_of(run), overrides(run)
    recipe = load_recipe(recipe_path, given)
    ref = reference(reference_overrides(run), recipe_path)
    got = train_metrics(tmp_path, world(run), [*given, "logging.layout=true"], recipe_path)
    check_layout(tmp_path, recipe)  # every rank holds every parameter as the plans promise
    keys = ("loss", "grad_norm", "aux_loss") if run["model"] == "moe" else ("loss", "grad_norm")
    worst = assert_parity(got, ref, scheduled_lrs(recipe_path, given), keys=keys, tol=tolerance(run))
    for key, rel in worst.items():
        record_property(f"max_rel_{key}", rel)  # shown with --junitxml
    if run["model"] == "moe" and run["dtype"] == "float32" and run["compile"] == "eager":
        assert [g["tokens_per_expert"] for g in got] == [r["tokens_per_expert"] for r in ref]
    print(f"{name(run)}: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    assert got[-1]["loss"] < got[0]["loss"]  # and it learned
    check_comm(tmp_path, recipe)  # and hands each collective the bytes plan's estimate gives
