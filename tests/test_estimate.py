"""dtensor3d/estimate.py: the analytical cost of a step, checked by hand-counted shapes and
against what real ranks hold and hand to collectives (counted by intercepting them)."""

import json

import pytest
from conftest import PARITY, ROOT, torchrun

from dtensor3d.estimate import KINDS, bubble_fraction, comm_bytes, estimate, in_flight, shard_numel
from dtensor3d.recipe import load_recipe

# The parity recipe's parameter shapes (vocab 256, hidden 64, 8 heads / 4 kv heads of 8, inter 128).
EMBED, LAYER_SHAPES, NORM = [256, 64], [[64, 64], [32, 64], [32, 64], [64, 64], [128, 64], [128, 64], [64, 128]], [64]


def recipe(*overrides):
    return load_recipe(PARITY, list(overrides))


def test_params_world1_is_the_model():
    est = estimate(recipe())
    per_layer = sum(a * b for a, b in LAYER_SHAPES) + 2 * 64
    assert [s["params"] for s in est["stages"]] == [4 * per_layer + 2 * 256 * 64 + 64]
    s = est["stages"][0]
    assert s["param_bytes"] == s["grad_bytes"] == 4 * s["params"]
    # AdamW: two fp32 moments per element and one fp32 step scalar per tensor (4 x 9 + 3 tensors)
    assert s["optimizer_bytes"] == 8 * s["params"] + 4 * 39


def test_params_fsdp_uneven_rows_are_padded():
    """dp 3: FSDP2 cuts dim 0 in chunks of ceil(d0 / 3); rank 0 holds a whole chunk."""
    est = estimate(recipe("parallelism.dp=3", "training.global_batch_size=3"))
    rows = lambda shape: -(-shape[0] // 3) * (shape[1] if len(shape) > 1 else 1)  # noqa: E731
    layer = sum(rows(s) for s in LAYER_SHAPES) + 2 * rows(NORM)
    assert est["stages"][0]["params"] == 4 * layer + 2 * rows(EMBED) + rows(NORM)
    assert shard_numel([32, 64], 3) == 11 * 64 and shard_numel([2, 5], 3) == 5 and shard_numel([0, 5], 3) == 0


def test_params_tp_pp_split_the_plan_way():
    """tp 2 x pp 2: colwise q/k/v/gate/up and the head split dim 0, rowwise o/down dim 1,
    the embedding its vocabulary; norms whole. Stage 0 has the embedding, stage 1 the head."""
    est = estimate(recipe("parallelism.tp=2", "parallelism.pp=2", "training.global_batch_size=2"))
    layer = sum(a * b for a, b in LAYER_SHAPES) // 2 + 2 * 64
    assert [s["params"] for s in est["stages"]] == [2 * layer + 128 * 64, 2 * layer + 128 * 64 + 64]


def test_bubble_and_microbatches_in_flight():
    r = recipe("parallelism.pp=4", "training.global_batch_size=8")
    assert bubble_fraction(r) == pytest.approx(3 / 11)
    assert [in_flight(r, s) for s in range(4)] == [4, 3, 2, 1]
    r = recipe("parallelism.pp=2", "parallelism.pp_engine=afab", "training.global_batch_size=8")
    assert [in_flight(r, s) for s in range(2)] == [8, 8]
    assert in_flight(recipe(), 0) == 1 and bubble_fraction(recipe()) == 0.0


def test_recompute_keeps_less_and_talks_more():
    plain = estimate(recipe("parallelism.tp=2", "training.global_batch_size=2"))["stages"][0]
    again = estimate(recipe("parallelism.tp=2", "training.global_batch_size=2", "parallelism.recompute_layer=true"))
    again = again["stages"][0]
    assert again["activation_bytes"] < plain["activation_bytes"]
    assert again["comm_bytes_per_step"]["tp"]["all_reduce"] > plain["comm_bytes_per_step"]["tp"]["all_reduce"]


def test_step_time_from_peak_and_mfu():
    r = recipe("parallelism.dp=2")
    est = estimate(r, peak_tflops=100.0, mfu=0.5)
    assert est["step_time_s"] == pytest.approx(est["flops_per_step"] / (2 * 100e12 * 0.5))
    assert est["tokens_per_sec"] == pytest.approx(8 * 32 / est["step_time_s"])


# Every parity run (tests/test_parity.py, tests/test_moe_parity.py) already checks each
# rank's bytes per collective against the estimate (tests/sharding.py check_comm). The mesh
# below is the one they lack: FSDP2 with uneven shards (dp 3), whose padding the estimate
# must count. It runs 2 steps on 3 CPU ranks; step 2 is counted.
MEASURED = {
    "dp3_uneven": ["parallelism.dp=3", "training.global_batch_size=3"],
}


@pytest.mark.parametrize("name", list(MEASURED))
def test_estimate_equals_measured(name):
    """Every rank's bytes per collective kind and mesh dim, and rank 0 of each stage's
    parameters, gradients and optimizer state, equal the estimate exactly."""
    overrides = (["training.global_batch_size=4"] if "dp3" not in name else []) + MEASURED[name]
    r = recipe(*overrides)
    world = r.parallelism.world_size
    out = torchrun(world, [str(ROOT / "tests/dist_scripts/comm_bytes.py"), PARITY, *overrides], timeout=900).stdout
    # ranks print concurrently: lines may run together, so decode from each "COMM " marker
    ranks = [json.JSONDecoder().raw_decode(piece)[0] for piece in out.split("COMM ")[1:]]
    assert len(ranks) == world
    comm, stages = comm_bytes(r, backend="gloo"), estimate(r, backend="gloo")["stages"]
    for rank in ranks:
        stage = rank["coords"]["pp"]
        expected = {d: {k: kinds[k] for k in KINDS if kinds[k]} for d, kinds in comm[stage].items() if kinds["total"]}
        assert rank["bytes"] == expected, (rank["rank"], rank["coords"])
        if rank["coords"]["dp"] == rank["coords"]["cp"] == rank["coords"]["ep"] == 0:
            for key in ("params", "param_bytes", "grad_bytes", "optimizer_bytes"):
                assert rank[key] == stages[stage][key], (key, rank["rank"])
