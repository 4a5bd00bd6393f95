"""Initialization: the distribution README 'Initialization' documents, per parameter kind,
and topology independence: full weights gathered from a dp2 x tp2 x pp2 mesh (FSDP2 +
DTensor TP + pipeline stages) equal the 1-process init bit for bit."""

import math

import pytest
import torch
from helpers import MOE, PARITY, ROOT, torchrun
from safetensors.torch import load_file

from dtensor3d.config.load import load_recipe
from dtensor3d.models import build_on_meta, materialize
from dtensor3d.parallel.shards import init_weights

INIT_STD = 0.02  # README: every weight matrix, embedding, router and expert


def gathered(out, nproc, overrides):
    out.mkdir()
    torchrun(nproc, ["tests/dist_scripts/dump_init.py", str(out), PARITY, *overrides])
    weights = {}
    for f in sorted(out.glob("rank*.safetensors")):
        weights.update(load_file(f))
    return weights


def test_init_bitwise_across_meshes(tmp_path):
    # Qwen2: q/k/v biases (split over tp with their rows) beside the weights and norms.
    one = gathered(tmp_path / "one", 1, ["model.family=qwen2"])
    mesh = ["parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2"]
    many = gathered(tmp_path / "eight", 8, ["model.family=qwen2", *mesh])
    assert sorted(one) == sorted(many)
    assert "model.layers.3.self_attn.q_proj.bias" in one and "lm_head.weight" in one
    for name in one:
        assert torch.equal(one[name], many[name]), name
    check_documented(one, seed=7)


def initialized(recipe_path: str, overrides: list[str], seed: int = 7) -> dict[str, torch.Tensor]:
    """The model of a recipe initialised in this process (one rank, no process group)."""
    model = materialize(build_on_meta(load_recipe(recipe_path, overrides).model), "cpu")
    init_weights(model, seed)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def kind(name: str) -> str:
    if name.endswith("norm.weight"):
        return "norm"
    return "bias" if name.endswith((".bias", ".e_score_correction_bias")) else "weight"


def check_documented(weights: dict[str, torch.Tensor], seed: int) -> dict[str, int]:
    """Norm weights exactly 1, biases exactly 0, every other parameter N(0, INIT_STD^2): the
    std of each tensor of >= 4096 values within 5% (its sampling error is under 1.2%), the
    mean within 4 standard errors of 0; returns the count of each kind."""
    count = {"norm": 0, "bias": 0, "weight": 0}
    for name, t in weights.items():
        count[kind(name)] += 1
        if kind(name) == "norm":
            assert torch.equal(t, torch.ones_like(t)), name
        elif kind(name) == "bias":
            assert torch.equal(t, torch.zeros_like(t)), name
        else:
            t = t.double()
            assert abs(t.mean().item()) <= 4 * INIT_STD / math.sqrt(t.numel()), (name, t.mean().item())
            if t.numel() >= 4096:
                assert abs(t.std().item() / INIT_STD - 1) <= 0.05, (name, t.std().item())
    return count


@pytest.mark.parametrize(
    "recipe, overrides",
    [
        (PARITY, ["model.family=qwen2"]),  # q/k/v biases
        (PARITY, ["model.family=qwen3", "model.head_dim=24", "model.tie_word_embeddings=true"]),  # q/k norms, tied
        (MOE, ["model.shared_expert_intermediate_size=32", "model.moe_layers=[1, 3]"]),  # router, experts
        (str(ROOT / "tests" / "recipes" / "deepseek_parity.yaml"), []),  # MLA's norms, the correction bias
    ],
    ids=["qwen2", "qwen3_tied", "moe_shared_expert", "deepseek_v3"],
)
def test_init_follows_the_readme(recipe, overrides):
    weights = initialized(recipe, overrides)
    count = check_documented(weights, seed=7)
    assert count["norm"] >= 9 and count["weight"] >= 10, count
    assert (count["bias"] > 0) == ("model.family=qwen2" in overrides or "deepseek" in recipe), count
    if recipe == MOE:  # the router, the stacked experts and the shared expert are weights too
        assert {"gate.weight", "experts.w1", "shared_expert.gate_proj.weight"} <= {
            n.split("block_sparse_moe.")[1] for n in weights if "block_sparse_moe." in n
        }, sorted(weights)
    # Each parameter draws from its own seeded generator: another name, other values; the
    # same seed, the same values; another seed, others.
    q0, q1 = (weights[f"model.layers.{i}.self_attn.o_proj.weight"] for i in (0, 1))
    assert q0.shape == q1.shape and not torch.equal(q0, q1)
    again, other = initialized(recipe, overrides), initialized(recipe, overrides, seed=8)
    assert all(torch.equal(weights[n], again[n]) for n in weights)
    assert all(torch.equal(weights[n], other[n]) == (kind(n) != "weight") for n in weights)
