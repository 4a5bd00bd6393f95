"""fsdp_reshard_after_forward: auto (plan/reshard.py): never with the largest bucket whose
plan peak fits training.memory_fraction of the device, else torchtitan's default. In-process."""

import subprocess
import sys

from helpers import PARITY, ROOT

from dtensor3d.config.load import load_recipe
from dtensor3d.plan.estimate import peak_bytes, resolve_reshard


def test_auto_picks_never_with_every_layer_in_one_unit_where_it_fits():
    recipe = load_recipe(PARITY, ["parallelism.dp=2"])
    assert recipe.parallelism.fsdp_reshard_after_forward == "auto"
    decided, line = resolve_reshard(recipe, 2**30)
    p = decided.parallelism
    assert (p.fsdp_reshard_after_forward, p.fsdp_bucket_layers) == ("never", recipe.model.num_hidden_layers)
    assert "never with fsdp_bucket_layers 4" in line and not p.reshard_after_forward


def test_auto_falls_back_to_default_where_never_does_not_fit():
    recipe = load_recipe(PARITY, ["parallelism.dp=2"])
    never = resolve_reshard(recipe, 2**30)[0]
    budget = peak_bytes(never) / 0.9 - 1  # just short of the peak never needs at memory_fraction 0.9
    decided, line = resolve_reshard(recipe, budget)
    assert decided.parallelism.fsdp_reshard_after_forward == "default" and decided.parallelism.reshard_after_forward
    assert line.startswith("fsdp_reshard_after_forward auto: default (never needs")
    enough = peak_bytes(never) / 0.9 + 1  # and just over it
    assert resolve_reshard(recipe, enough)[0].parallelism.fsdp_reshard_after_forward == "never"


def test_auto_leaves_explicit_values_and_runs_without_fsdp_alone():
    explicit = load_recipe(PARITY, ["parallelism.dp=2", "parallelism.fsdp_reshard_after_forward=always"])
    assert resolve_reshard(explicit, 2**30) == (explicit, None)
    single = load_recipe(PARITY, [])
    decided, line = resolve_reshard(single, 2**30)
    assert line is None and decided.parallelism.fsdp_reshard_after_forward == "default"


def test_memory_fraction_above_one_is_refused_at_the_door():
    cmd = [sys.executable, "-m", "dtensor3d", "validate", PARITY, "training.memory_fraction=1.5"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.splitlines() == ["error: training.memory_fraction=1.5 must be a share in (0, 1], e.g. 0.9"]
