"""Pipeline schedules with several stages per rank (issue 13 item 3): interleaved_1f1b, zbv
and dualpipev from torch.distributed.pipelining: their stage placement, their door checks,
and a checkpoint saved under 1f1b resumed under zbv (names are global whatever the
schedule). Their loss parity: tests/parallel/test_matrix.py."""

import json

import pytest
from helpers import PARITY, TOL, train_metrics

from dtensor3d.config.load import load_recipe
from dtensor3d.errors import RecipeError
from dtensor3d.parallel.pipeline import local_stages

# Each schedule's loss parity, alone and with dp, tp, cp, ep, recompute and the other options,
# is the combination matrix's (tests/parallel/test_matrix.py).


def test_stage_placement():
    """interleaved loops the stages over the ranks; the V schedules fold them back."""
    inter = load_recipe(PARITY, ["parallelism.pp=2", "parallelism.pp_engine=interleaved_1f1b"]).parallelism
    zbv = load_recipe(PARITY, ["parallelism.pp=2", "parallelism.pp_engine=zbv"]).parallelism
    assert [local_stages(r, inter) for r in range(2)] == [[0, 2], [1, 3]]
    assert [local_stages(r, zbv) for r in range(2)] == [[0, 3], [1, 2]]


@pytest.mark.parametrize(
    "overrides, words",
    [
        (
            ["parallelism.pp_engine=interleaved_1f1b", "training.global_batch_size=5"],
            "valid microbatch counts: 2, 3, 4, 6",
        ),
        (["parallelism.pp_engine=dualpipev", "training.global_batch_size=2"], "valid microbatch counts: 4, 5"),
        (["parallelism.pp_engine=interleaved_1f1b", "parallelism.pp_virtual_stages=3"], "valid stages per rank: 2"),
        (["parallelism.pp_engine=zbv", "parallelism.pp_virtual_stages=3"], "valid: 0 or 2"),
        (["parallelism.pp_engine=1f1b", "parallelism.pp_virtual_stages=2"], "valid: 0 or 1"),
        (["parallelism.pp_engine=zbv", "parallelism.pp_layers=[1, 3]"], "pp_layers applies to one stage per rank"),
        (["parallelism.pp_engine=dualpipev", "parallelism.recompute=selective"], "valid: none or full"),
    ],
)
def test_refused_at_the_door(overrides, words):
    with pytest.raises(RecipeError, match=words.replace("[", r"\[")):
        load_recipe(PARITY, ["parallelism.pp=2", *overrides])


def test_checkpoint_from_1f1b_resumes_under_zbv(parity_reference, shared_run, tmp_path):
    """Save at step 5 under 1f1b (pp 2), resume under zbv (pp 2: two stages per rank, other
    layers on each rank): steps 6-10 continue the 1-process trajectory."""
    _, root = shared_run(2, ["parallelism.pp=2", "checkpoint.dir={root}/ck", "checkpoint.interval=5"])
    step5 = sorted(p for p in (root / "ck").iterdir() if p.name.endswith("5"))[0]
    resumed = train_metrics(
        tmp_path / "zbv",
        2,
        [
            "parallelism.pp=2",
            "parallelism.pp_engine=zbv",
            f"checkpoint.dir={tmp_path}/ck2",
            f"checkpoint.resume={step5}",
        ],
    )
    assert [r["step"] for r in resumed] == list(range(6, 11)), json.dumps(resumed)[:500]
    for g, r in zip(resumed, parity_reference[5:]):
        for key in ("loss", "grad_norm"):
            assert abs(g[key] - r[key]) <= TOL * abs(r[key]), (g["step"], key, g[key], r[key])
