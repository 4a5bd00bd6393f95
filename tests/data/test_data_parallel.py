"""FSDP2 reduce-scatters gradients once per FSDP unit per optimizer step, not once per
microbatch: counted on real gloo ranks by wrapping the collective FSDP calls."""

import json

import pytest
from helpers import PARITY, ROOT, torchrun

MOE = str(ROOT / "tests" / "recipes" / "moe_parity.yaml")
LAYERS = 4  # num_hidden_layers of both test recipes

# One FSDP unit per decoder block: torchtitan's reshard policy (auto, the default, may bucket
# blocks into fewer units: tests/plan/test_reshard.py).
DEFAULT_UNITS = "parallelism.fsdp_reshard_after_forward=default"
CASES = {
    # ep 2 x dp 1 x cp 1: the dense parameters are sharded over ep; experts (split over ep)
    # are FSDP units on a 1-rank dp x cp mesh, which never reduce-scatters.
    "ep2_dp1": (MOE, ["parallelism.ep=2", DEFAULT_UNITS]),
    "dp2": (PARITY, ["parallelism.dp=2", DEFAULT_UNITS]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_one_reduce_scatter_per_unit_per_step(name):
    recipe, overrides = CASES[name]
    out = torchrun(2, ["tests/dist_scripts/fsdp_sync.py", recipe, *overrides]).stdout
    result = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert result["microbatches"] == 4
    # One reduce-scatter per decoder block and one for the root (embedding, norm, head).
    assert result["per_step"] == [LAYERS + 1, LAYERS + 1], result
