"""`plan` without torch, and `plan --simulate`: the estimate's parameter table against the
real model, and one rank's real parallelized model (built on the meta device under torch's
fake process group) against the estimate, parameter by parameter."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import PARITY

from dtensor3d.config.load import load_recipe
from dtensor3d.models import stored_name
from dtensor3d.plan.estimate import estimate
from dtensor3d.plan.params import param_table, shard_numel
from dtensor3d.plan.shapes import param_shapes, tp_dim

REPO = Path(__file__).resolve().parents[2]
MOE = str(REPO / "tests/recipes/moe_parity.yaml")
DEEPSEEK = str(REPO / "tests/recipes/deepseek_parity.yaml")


def run_plan(*args: str, importtime: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    flags = ["-X", "importtime"] if importtime else []
    cmd = [sys.executable, *flags, "-m", "dtensor3d", "plan", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def imported(stderr: str) -> set[str]:
    """Module names from `python -X importtime`'s lines ("import time: self | cumulative | name")."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


# -- plan is torch-free ------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["recipes/llama3_405b_plan.yaml", "--json", "--gpu", "H200"],
        [MOE, "parallelism.ep=2", "parallelism.tp=2", "parallelism.pp=2", "training.global_batch_size=4"],
        ["recipes/llama3_70b_plan.yaml", "--simulate", "--rank", "1024"],  # refused before torch
    ],
)
def test_plan_imports_no_torch(args):
    p = run_plan(*args, importtime=True)
    modules = imported(p.stderr)
    assert "dtensor3d.config.schema" in modules and "yaml" in modules  # the probe sees imports at all
    assert not {m for m in modules if m == "torch" or m.startswith("torch.")}
    if "--simulate" in args:
        errors = [line for line in p.stderr.splitlines() if not line.startswith("import time:")]
        assert p.returncode == 2 and p.stdout == "" and len(errors) == 1
        assert errors[0] == "error: plan --simulate --rank 1024: the mesh has 1024 ranks; valid: 0..1023"
    else:
        assert p.returncode == 0 and p.stdout


# -- the shape table is the model's ------------------------------------------------------


def model_configs():
    dense = load_recipe(PARITY).model
    moe = load_recipe(MOE).model
    return {
        "dense": dense,
        "dense_tied": dataclasses.replace(dense, tie_word_embeddings=True),
        "moe": moe,
        "moe_shared_some_layers": dataclasses.replace(moe, shared_expert_intermediate_size=48, moe_layers=(1, 3)),
        "gqa_wide": dataclasses.replace(dense, num_attention_heads=4, num_key_value_heads=1, intermediate_size=176),
        "qwen2": dataclasses.replace(dense, family="qwen2"),
        "qwen3_head_dim": dataclasses.replace(dense, family="qwen3", head_dim=24, attention_bias=True),
        "llama_biases": dataclasses.replace(dense, attention_bias=True, mlp_bias=True),
        # OLMo 2's norms after the sublayers and its whole-projection q/k norms; SmolLM3's NoPE layer
        "olmo2": dataclasses.replace(dense, family="olmo2", attention_bias=True),
        "gemma3_sandwich": dataclasses.replace(
            dense, family="gemma3_text", hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True
        ),
        "smollm3_nope": dataclasses.replace(dense, family="smollm3", nope_layers=(3,), sliding_window=8),
        "deepseek_v3": load_recipe(DEEPSEEK).model,  # multi-head latent attention, low-rank q
        # multi-token prediction (models/mtp.py): MTP modules of the family's block kind
        "deepseek_v3_mtp": dataclasses.replace(load_recipe(DEEPSEEK).model, num_nextn_predict_layers=1),
        "dense_tied_mtp2": dataclasses.replace(dense, tie_word_embeddings=True, num_nextn_predict_layers=2),
        "deepseek_v3_full_q_bias": dataclasses.replace(
            load_recipe(DEEPSEEK).model, q_lora_rank=None, attention_bias=True
        ),
        # gpt-oss: attention sinks and biases, experts and router with biases, every other layer sliding
        "gpt_oss": dataclasses.replace(
            moe, family="gpt_oss", attention_bias=True, swiglu_limit=7.0, sliding_window=8, layer_types=None
        ),
        # Qwen3-MoE's pattern with DeepSeek's pieces: first layer dense, layer 2 dense, moe
        # width 40, two shared experts, the correction bias of balancing
        "qwen3_moe_shared_dense_balanced": dataclasses.replace(
            moe,
            family="qwen3_moe",
            moe_intermediate_size=40,
            n_shared_experts=2,
            first_k_dense_replace=1,
            mlp_only_layers=(2,),
            router_bias_update_rate=0.01,
        ),
    }


@pytest.mark.parametrize("name", list(model_configs()))
def test_param_shapes_equal_meta_model(name):
    from dtensor3d.models import build_on_meta

    cfg = model_configs()[name]
    real = [(n, tuple(q.shape)) for n, q in build_on_meta(cfg).named_parameters()]
    assert real == list(param_shapes(cfg).items())


# split tensors: embedding, head; q/k/v/o of 4 layers; gate/up/down of the dense ones; the
# column-parallel biases (q/k/v, gate/up)
SPLIT = {
    "moe_shared_some_layers": 2 + 2 * 4 + 2 * 7,
    "llama_biases": 2 + 4 * (7 + 5),
    "qwen3_head_dim": 2 + 4 * (7 + 3),
    # q_b (or q) / kv_b / o of 4 layers, gate/up/down of the dense layer 0
    "deepseek_v3": 2 + 4 * 3 + 3,
    "deepseek_v3_full_q_bias": 2 + 4 * 3 + 3,
    "olmo2": 2 + 4 * (7 + 3 + 2),  # and the q/k norms over the whole projection, split like its columns
    "gpt_oss": 2 + 4 * (7 + 1),  # q/k/v/o and q/k/v's biases, and the sinks split with the heads
}


@pytest.mark.parametrize("config", list(SPLIT))
def test_tp_dim_reads_the_tp_plan(config):
    """Colwise: a Linear's dim 0 (and its bias'); Rowwise: a Linear's dim 1, an Embedding's
    dim 0; a module absent from the plan (norms under ALL_REDUCE, router, experts), a
    row-parallel bias and a per-head q/k norm are whole."""
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from dtensor3d.models import build_on_meta
    from dtensor3d.parallel.tensor import ShardParameter, WholeProjectionNorm, tp_plan

    cfg = model_configs()[config]
    model, shared_key = build_on_meta(cfg), cfg.qk_rope_head_dim if cfg.mla else 0
    checked = 0
    for name, _ in model.named_parameters():
        path = name.rsplit(".", 1)[0]
        module = model.get_submodule(path)
        if name.startswith("model.layers."):
            layer = model.get_submodule(".".join(path.split(".")[:3]))
            moe = hasattr(layer, "block_sparse_moe")
            rows = tp_plan(False, moe, shared_key=shared_key, whole_norm=cfg.qk_norm_whole)[1]
            style = rows.get(path.split(".", 3)[3])
            if isinstance(rows.get(name.split(".", 3)[3]), ShardParameter):  # a row naming the parameter itself
                style = rows[name.split(".", 3)[3]]
        else:
            style = tp_plan(False)[0].get(path)
        expected = None
        if name.endswith(".bias"):  # a column-parallel bias is split like its rows, a row-parallel one whole
            expected = 0 if isinstance(style, ColwiseParallel) else None
        elif isinstance(style, ColwiseParallel):
            expected = 1 if isinstance(module, nn.Embedding) else 0
        elif isinstance(style, RowwiseParallel):
            expected = 0 if isinstance(module, nn.Embedding) else 1
        elif isinstance(style, WholeProjectionNorm):
            expected = 0
        elif isinstance(style, ShardParameter):
            expected = style.dim
        assert tp_dim(name, cfg) == expected, name
        checked += expected is not None
    assert checked == SPLIT[config]


# -- --simulate against the estimate -----------------------------------------------------

MESHES = {
    # tied embeddings under pp: the last stage holds its own copy of the matrix
    "tp2_pp2_tied": (
        PARITY,
        ["parallelism.tp=2", "parallelism.pp=2", "training.global_batch_size=2", "model.tie_word_embeddings=true"],
    ),
    "tp2_sp_dp2_fsdp": (PARITY, ["parallelism.tp=2", "parallelism.dp=2", "parallelism.tp_mode=REDUCE_SCATTER"]),
    "dp3_fsdp_uneven": (PARITY, ["parallelism.dp=3", "training.global_batch_size=3"]),
    "pp2_uneven_layers_dp2": (PARITY, ["parallelism.pp=2", "parallelism.pp_layers=[3,1]", "parallelism.dp=2"]),
    "cp2_dp2": (PARITY, ["parallelism.cp=2", "parallelism.dp=2"]),
    "hybrid_dp4_shard2_tp2": (
        PARITY,
        ["parallelism.dp=4", "parallelism.dp_mode=hybrid", "parallelism.dp_shard=2", "parallelism.tp=2"],
    ),
    "replicate_tp2_dp2": (PARITY, ["parallelism.tp=2", "parallelism.dp=2", "parallelism.dp_mode=replicate"]),
    "moe_ep2_dp2_tp2": (MOE, ["parallelism.ep=2", "parallelism.dp=2", "parallelism.tp=2"]),
    "moe_ep4_pp2_fsdp": (MOE, ["parallelism.ep=4", "parallelism.pp=2"]),
    "moe_ep2_cp2_replicate": (MOE, ["parallelism.ep=2", "parallelism.cp=2", "parallelism.dp_mode=replicate"]),
    # several stages per rank: rank r holds layers r and r + 2 (interleaved), r and 3 - r with
    # the embedding and the head both on rank 0 (zbv's V)
    "pp2_interleaved_tp2": (PARITY, ["parallelism.pp=2", "parallelism.pp_engine=interleaved_1f1b", "parallelism.tp=2"]),
    "pp2_zbv_dp2_fsdp_tied": (
        PARITY,
        ["parallelism.pp=2", "parallelism.pp_engine=zbv", "parallelism.dp=2", "model.tie_word_embeddings=true"],
    ),
    # multi-token prediction: its modules and its copy of the embedding on the last stage
    "mtp_tp2_pp2_dp2": (
        MOE,
        ["model.num_nextn_predict_layers=1", "parallelism.tp=2", "parallelism.pp=2", "parallelism.dp=2"],
    ),
    # tied at zbv: rank 0 holds three copies (the first stage's embedding, the last's MTP copy
    # and head: parallel/tied.py's `copies`); tied at 1f1b: the MTP copy is the head's parameter
    "mtp2_pp2_zbv_tied": (
        PARITY,
        [
            "model.num_nextn_predict_layers=2",
            "parallelism.pp=2",
            "parallelism.pp_engine=zbv",
            "model.tie_word_embeddings=true",
        ],
    ),
    "mtp2_pp2_1f1b_tied": (
        PARITY,
        ["model.num_nextn_predict_layers=2", "parallelism.pp=2", "model.tie_word_embeddings=true"],
    ),
    # optimizer.state_dtype: the optimizer bytes of each real parameter (plan/state_bytes.py's
    # param_state_bytes on the rank's shards) against the estimate's; dp 2's 8-bit states are
    # 279,452 B on rank 0, what the ranks measured (bench/plan_accuracy.py's AdamW column)
    "dp2_fsdp_state_8bit": (PARITY, ["parallelism.dp=2", "optimizer.state_dtype=8bit"]),
    "tp2_dp2_state_bf16": (PARITY, ["parallelism.tp=2", "parallelism.dp=2", "optimizer.state_dtype=bfloat16"]),
    "moe_ep2_dp2_muon_8bit": (
        MOE,
        ["parallelism.ep=2", "parallelism.dp=2", "optimizer.name=muon", "optimizer.state_dtype=8bit"],
    ),
    # row-parallel shards 256 wide: whole 8-bit blocks under tp (the parity model's 32 are refused)
    "tp2_wide_state_8bit": (
        PARITY,
        [
            "parallelism.tp=2",
            "optimizer.state_dtype=8bit",
            "model.hidden_size=512",
            "model.intermediate_size=1024",
            "model.num_hidden_layers=2",
        ],
    ),
}


def check_rank(recipe, sim: dict, table: dict, est: dict) -> None:
    """One simulated rank against the estimate, parameter by parameter."""
    stage = sim["stage"]
    assert set(sim["parameters"]) == {n for n, row in table.items() if row["stage"] == stage}
    fsdp = recipe.parallelism.fsdp_enabled
    for name, entry in sim["parameters"].items():
        row = table[name]
        assert entry["shape"] == list(param_shapes(recipe.model)[stored_name(recipe.model, name)])
        assert entry["stored_numel"] == shard_numel(row["shape"], row["group"] if fsdp else 1), name
        if not fsdp:
            assert entry["local_shape"] == row["shape"], name
    est_row = est["stages"][stage]
    assert sim["params_stored"] == est_row["params"]
    assert sim["param_bytes"] == est_row["param_bytes"]
    assert sim["params"] <= est_row["params"] and sim["optimizer_bytes"] <= est_row["optimizer_bytes"]


@pytest.mark.parametrize("name", list(MESHES))
def test_simulate_every_rank_agrees_with_estimate(name):
    """Every rank stores exactly the estimate's params of its stage (FSDP2 pads each chunk to
    ceil(d0 / n) rows), each parameter's piece is the one the estimate cuts, and the rank
    with the largest chunks holds exactly the estimate's params and optimizer bytes."""
    from dtensor3d.plan.simulate import simulate

    path, overrides = MESHES[name]
    overrides = ([] if any("batch_size" in o for o in overrides) else ["training.global_batch_size=8"]) + overrides
    recipe = load_recipe(path, overrides)
    table, est = param_table(recipe), estimate(recipe)
    sims = [simulate(recipe, r) for r in range(recipe.parallelism.world_size)]
    for sim in sims:
        check_rank(recipe, sim, table, est)
    for stage, row in enumerate(est["stages"]):
        mine = [s for s in sims if s["stage"] == stage]
        assert max(s["params"] for s in mine) == row["params"]
        assert max(s["optimizer_bytes"] for s in mine) == row["optimizer_bytes"]


@pytest.mark.parametrize(
    "path, ranks", [("recipes/llama3_70b_plan.yaml", [0, 517, 1023]), ("recipes/llama3_405b_plan.yaml", [0, 777, 1023])]
)
def test_simulate_planning_recipes(path, ranks):
    """1,024-rank meshes: the first, a middle and the last rank agree with the estimate."""
    from dtensor3d.plan.simulate import simulate

    recipe = load_recipe(str(REPO / path))
    table, est = param_table(recipe), estimate(recipe)
    for rank in ranks:
        sim = simulate(recipe, rank)
        check_rank(recipe, sim, table, est)
        assert sim["params"] == est["stages"][sim["stage"]]["params"]  # dims divide evenly: no padding


def test_simulate_command_json_and_text():
    overrides = ["parallelism.dp=3", "training.global_batch_size=3"]
    p = run_plan(PARITY, *overrides, "--simulate", "--rank", "2", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert {"world_size", "dims", "groups", "estimate", "simulate"} <= set(out)
    sim = out["simulate"]
    assert sim["rank"] == 2 and sim["coords"]["dp"] == 2 and sim["agrees"] is True
    embed = sim["parameters"]["model.embed_tokens.weight"]
    assert embed["shape"] == [256, 64] and embed["local_shape"] == [84, 64] and embed["stored_numel"] == 86 * 64
    assert embed["placements"] == ["S(0)"] and embed["mesh"] == ["ep_dp_cp"]
    p = run_plan(PARITY, *overrides, "--rank", "1")
    assert p.returncode == 2 and p.stderr.startswith("error:") and "--simulate" in p.stderr
