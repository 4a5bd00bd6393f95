"""Expert-parallel loss parity: each mesh against the 1-process run of the MoE recipe (the
parity runs' short form, helpers.SHORT: 6 AdamW steps, fp32, CPU, load-balancing loss on),
relative <= 1e-5 at every step for loss, grad_norm and the aux loss; tokens per expert equal."""

from pathlib import Path

import pytest
import torch
from helpers import ROOT, check_comm, check_layout, short, train_metrics, world

from dtensor3d.checkpoint import load_model
from dtensor3d.config.load import load_recipe

TOL = 1e-5
MOE = str(ROOT / "tests" / "recipes" / "moe_parity.yaml")

# ep 2 with every other option (dp_mode, cp, tp modes, pp schedules, a shared expert,
# moe_layers, bf16, compile) is the combination matrix's (tests/parallel/test_matrix.py).
# Here: what its table leaves out, ep 4 and ep 2 in four dimensions (16 ranks), and the
# schedules with two stages per rank in fp32 at 2 ranks (the table's are rotating runs).
CONFIGS = {
    # Expert gradients of their true size (pytorch #160285: 2x at ep 2): grad_norm at step 1.
    "ep4": ["parallelism.expert_parallel_size=4"],
    "ep2_pp2_dp2_tp2": [
        *("parallelism.ep=2", "parallelism.pp=2", "parallelism.dp=2", "parallelism.tp=2"),
        "training.micro_batch_size=1",  # two microbatches per dp x ep rank for pp 2
    ],
    # Two stages per rank (torchtitan #2061: its aux loss was right under 1f1b only, broken
    # under zbv and interleaved 1f1b): each rank's second stage backpropagates its aux term too.
    "pp2_zbv": ["parallelism.pp=2", "parallelism.pp_engine=zbv"],
    "pp2_interleaved": [
        *("parallelism.pp=2", "parallelism.pp_engine=interleaved_1f1b", "parallelism.pp_virtual_stages=2"),
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


# Qwen3-MoE's router (softmax top-2 without renormalising, experts 64 wide, layer 2 dense)
# with aux-loss-free balancing on (gamma 0.01), 6 steps, a checkpoint at the end.
QWEN3_MOE_BALANCED = [
    "model.family=qwen3_moe",
    "model.norm_topk_prob=false",
    "model.moe_intermediate_size=64",
    "model.mlp_only_layers=[2]",
    "model.router_bias_update_rate=0.01",
]


def final_biases(ck: Path) -> dict[int, torch.Tensor]:
    """Each MoE layer's e_score_correction_bias in the run's last checkpoint."""
    model = load_model(ck)
    return {int(i): layer.block_sparse_moe.gate.e_score_correction_bias for i, layer in model.model.layers.items()
            if hasattr(layer, "block_sparse_moe")}  # fmt: skip


def test_qwen3_moe_balancing_ep2_cp2(tmp_path, record_property):
    """Qwen3-MoE at ep 2 x cp 2 against one process: loss, grad norm, aux and val loss <= 1e-5
    relative, tokens per expert of every layer equal; the correction bias after 6 steps equal
    at both meshes and equal to the update rule applied by hand to the logged per-layer loads:
    bias = sum over steps of 0.01 * sign(mean load - load) (its logged [min, max] at every step
    too: at gamma 0.01 against a fresh router's near-equal scores the bias swings back and forth)."""
    overrides = short(QWEN3_MOE_BALANCED)
    one = train_metrics(tmp_path / "one", 1, [*overrides, f"checkpoint.dir={tmp_path / 'one_ck'}"], MOE)
    mesh = ["parallelism.ep=2", "parallelism.cp=2"]
    got = train_metrics(
        tmp_path / "run", 4, [*overrides, *mesh, "logging.layout=true", f"checkpoint.dir={tmp_path / 'ck'}"], MOE
    )
    recipe = load_recipe(MOE, [*overrides, *mesh])
    check_layout(tmp_path / "run", recipe)
    check_comm(tmp_path / "run", recipe)
    assert [r["step"] for r in got] == [r["step"] for r in one] == list(range(1, 7))
    worst = 0.0
    for g, r in zip(got, one):
        for key in ("loss", "grad_norm", "aux_loss") + (("val_loss",) if "val_loss" in r else ()):
            rel = abs(g[key] - r[key]) / abs(r[key])
            assert rel <= TOL, f"step {r['step']} {key}: {g[key]!r} vs 1-process {r[key]!r} (rel {rel:.2e})"
            worst = max(worst, rel)
        assert g["tokens_per_expert_by_layer"] == r["tokens_per_expert_by_layer"], r["step"]
        assert g["router_bias_range"] == r["router_bias_range"], r["step"]
    record_property("max_rel", worst)
    ours, theirs = final_biases(tmp_path / "ck"), final_biases(tmp_path / "one_ck")
    assert sorted(ours) == [0, 1, 3]  # layer 2 is dense (mlp_only_layers)
    moved = 0.0
    for row, layer in enumerate(sorted(ours)):
        by_hand = torch.zeros(8)
        for r in one:
            load = torch.tensor(r["tokens_per_expert_by_layer"][row], dtype=torch.float32)
            by_hand += 0.01 * torch.sign(load.mean() - load)
            logged = r["router_bias_range"][row]  # the bias's [min, max] after this step's update
            assert abs(logged[0] - by_hand.min()) <= 1e-6 and abs(logged[1] - by_hand.max()) <= 1e-6, r["step"]
            moved = max(moved, by_hand.abs().max().item())
        assert torch.equal(ours[layer], theirs[layer]), layer
        assert (ours[layer] - by_hand).abs().max() <= 1e-7, (layer, ours[layer], by_hand)
    assert moved > 0  # the loads were unequal: the bias moved
