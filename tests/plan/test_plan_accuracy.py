"""bench/plan_accuracy.py's instruments: the live-bytes counter and the comm comparison."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from live_bytes import LiveBytes  # noqa: E402
from plan_accuracy import expected_comm  # noqa: E402


def test_live_bytes_counts_storages_once_and_frees():
    live = LiveBytes()
    with live:
        a = torch.empty(1000)  # 4,000 bytes
        view = a[10:20].view(2, 5)  # same storage: not counted again
        b = a * 2  # another 4,000
        assert live.now == 8000 and live.peak == 8000
        del b
        assert live.now == 4000
        live.reset_peak()
        c = torch.ones(250, dtype=torch.float64)  # 2,000
        assert live.peak == 6000
        c.untyped_storage().resize_(0)  # FSDP2's way of freeing a gathered parameter
        assert live.now == 4000
        c.untyped_storage().resize_(4000)
        assert live.now == 8000 and live.peak == 8000
        del a
        assert live.now == 8000  # the view still holds a's storage
        del view, c
        assert live.now == 0
    assert torch.UntypedStorage.resize_ is live._real_resize  # restored on exit


def test_expected_comm_merges_dims_sharing_a_group():
    kinds = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0, "all_to_all": 0, "send_recv": 0}
    stage = {
        "cp": dict(kinds, all_gather=10, all_reduce=1, total=11),
        "dp": dict(kinds, all_gather=5, total=5),
        "tp": dict(kinds, total=0),
        "world": dict(kinds, all_reduce=12, total=12),
    }
    assert expected_comm(stage, ["cp", "dp"]) == {
        "cp": {"all_gather": 10, "all_reduce": 1},
        "dp": {"all_gather": 5},
        "world": {"all_reduce": 12},
    }
    assert expected_comm(stage, ["cp+dp", "world"]) == {
        "cp+dp": {"all_gather": 15, "all_reduce": 1},
        "world": {"all_reduce": 12},
    }


def test_interleaved_selective_against_measurement():
    """One real run (2 CPU ranks, 2 steps): pp 2 under interleaved_1f1b (two stages per rank,
    8 microbatches) with recompute selective. Each rank's parameter, gradient and AdamW bytes
    and every byte it hands to a collective equal the estimate of its pp rank; its peak of
    live tensor bytes in step 2 is within 15% of the estimate's peak_bytes."""
    from plan_accuracy import DENSE, MESHES, ROOT, measure

    from dtensor3d.config.load import load_recipe
    from dtensor3d.plan.estimate import estimate

    path, overrides = MESHES["pp2 interl. selective"]
    recipe = load_recipe(str(Path(ROOT) / path), overrides)
    assert path == DENSE and recipe.parallelism.stages_per_rank == 2 and recipe.parallelism.recompute == "selective"
    est = estimate(recipe, backend="gloo")
    ranks = measure(path, overrides, recipe.parallelism.world_size)
    assert len(ranks) == 2
    for r in ranks:
        row = est["stages"][r["coords"]["pp"]]
        assert {k: r[k] for k in ("params", "param_bytes", "grad_bytes", "optimizer_bytes")} == {
            k: row[k] for k in ("params", "param_bytes", "grad_bytes", "optimizer_bytes")
        }
        assert r["comm"] == expected_comm(row["comm_bytes_per_step"], r["comm"]), r["rank"]
        assert abs(row["peak_bytes"] - r["peak"]) <= 0.15 * r["peak"], (r["rank"], row["peak_bytes"], r["peak"])


def _split_backward_live_bytes(recipe, layers: int) -> tuple[int, int]:
    """(live bytes I leaves, W's peak above that) for a stage of `layers` decoder layers of
    `recipe`'s model: forward, torch's stage_backward_input, stage_backward_weight."""
    from torch import nn
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from dtensor3d.models.layers import ModelHooks
    from dtensor3d.models.llama import DecoderLayer

    torch.manual_seed(0)
    stage = nn.Sequential(*[DecoderLayer(recipe.model, ModelHooks(recompute="full")) for _ in range(layers)])
    params = list(stage.parameters())
    for q in params:
        q.grad = torch.zeros_like(q)  # the step's gradients exist already (counted as grad_bytes)
    with LiveBytes() as live:
        for q in params:
            live.track(q)
        x, dy = torch.randn(1, 32, 64, requires_grad=True), torch.randn(1, 32, 64)
        y = stage(x)
        before_i = live.now
        _, groups = stage_backward_input([y], [dy], [x], iter(params))
        live.reset_peak()
        after_i = live.now
        stage_backward_weight(iter(params), groups)
        return after_i - before_i, live.peak - after_i


def test_zbv_weight_backward_recomputes_each_layer_per_parameter():
    """In one process, torch's own split backward (PipelineStage's I and W under zbv) through
    checkpointed parity layers (recompute full; 32 tokens, 8 KiB residual), live bytes
    counted. I leaves the gradients W reads and the input's gradient (8 KiB) -- not the layer
    it recomputed. W recomputes each layer once per parameter tensor (9) and keeps those
    copies until it ends: over 6 layers' activations per layer, within 15% of the estimate's
    weight_pass_bytes for 1 and 2 layers."""
    from dtensor3d.config.load import load_recipe
    from dtensor3d.plan.memory import layer_activation_bytes, split_backward_bytes, weight_pass_bytes

    overrides = ["parallelism.pp=2", "parallelism.pp_engine=zbv", "parallelism.recompute=full"]
    recipe = load_recipe(str(Path(__file__).resolve().parents[1] / "recipes/parity.yaml"), overrides)
    for layers in (1, 2):
        after_i, weight_pass = _split_backward_live_bytes(recipe, layers)
        span = range(1, 1 + layers)  # a stage other than the first (the first's W is a whole backward)
        assert abs(after_i - (split_backward_bytes(recipe, span) + 8_192)) <= 0.15 * after_i, (layers, after_i)
        assert weight_pass > 6 * layers * layer_activation_bytes(recipe, False), (layers, weight_pass)
        estimated = weight_pass_bytes(recipe, span, first=False)
        assert abs(estimated - weight_pass) <= 0.15 * weight_pass, (layers, estimated, weight_pass)
    assert weight_pass_bytes(recipe, range(1), first=True) == 0
