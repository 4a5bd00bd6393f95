"""Expert-parallel loss parity: each mesh against the 1-process run of the MoE recipe (the
parity runs' short form, helpers.SHORT: 6 AdamW steps, fp32, CPU, load-balancing loss on),
relative <= 1e-5 at every step for loss, grad_norm and the aux loss; tokens per expert equal."""

import pytest
from helpers import ROOT, check_comm, check_layout, short, train_metrics, world

from dtensor3d.config.load import load_recipe

TOL = 1e-5
MOE = str(ROOT / "tests" / "recipes" / "moe_parity.yaml")

# ep 2 with every other option (dp_mode, cp, tp modes, pp schedules, a shared expert,
# moe_layers, bf16, compile) is the combination matrix's (tests/parallel/test_matrix.py).
# Here: what its table leaves out, ep 4 and ep 2 in four dimensions (16 ranks).
CONFIGS = {
    "ep4": ["parallelism.expert_parallel_size=4"],
    "ep2_pp2_dp2_tp2": [
        *("parallelism.ep=2", "parallelism.pp=2", "parallelism.dp=2", "parallelism.tp=2"),
        "training.micro_batch_size=1",  # two microbatches per dp x ep rank for pp 2
    ],
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_moe_parity(name, reference, tmp_path, record_property):
    overrides = short(CONFIGS[name])
    recipe = load_recipe(MOE, overrides)
    moe_reference = reference(overrides, MOE)  # the 1-process run (conftest.reference)
    got = train_metrics(tmp_path, world(CONFIGS[name]), overrides + ["logging.layout=true"], MOE)
    check_layout(tmp_path, recipe)  # experts split over ep, and the rest
    check_comm(tmp_path, recipe)  # bytes per collective per mesh dim
    assert [r["step"] for r in got] == [r["step"] for r in moe_reference] == list(range(1, 7))
    worst = dict.fromkeys(("loss", "grad_norm", "aux_loss"), 0.0)
    for g, r in zip(got, moe_reference):
        for key in worst:
            rel = abs(g[key] - r[key]) / abs(r[key])
            assert rel <= TOL, f"step {r['step']} {key}: {g[key]!r} vs 1-process {r[key]!r} (rel {rel:.2e})"
            worst[key] = max(worst[key], rel)
        assert g["tokens_per_expert"] == r["tokens_per_expert"], r["step"]
        if r["step"] in (5, 6):  # the validation loss, forward only, at steps 5 and 6 (the last)
            rel = abs(g["val_loss"] - r["val_loss"]) / r["val_loss"]
            assert rel <= TOL, f"step {r['step']} val_loss: {g['val_loss']!r} vs {r['val_loss']!r} (rel {rel:.2e})"
    for key, rel in worst.items():
        record_property(f"max_rel_{key}", rel)  # shown with --junitxml
    assert "val_loss" in got[4] and "val_loss" in got[5]
    # 8 sequences x 32 tokens x top-2 x 4 MoE layers (or those of model.moe_layers) routed slots per step.
    moe_layers = recipe.model.moe_layers or range(recipe.model.num_hidden_layers)
    assert sum(moe_reference[0]["tokens_per_expert"]) == 8 * 32 * 2 * len(moe_layers)
