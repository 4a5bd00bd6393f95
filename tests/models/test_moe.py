"""The MoE layer on one device, and expert-parallel dispatch against it."""

import dataclasses
import json

import pytest
import torch
from helpers import torchrun

from dtensor3d.config.schema import ModelConfig
from dtensor3d.models.layers import ModelHooks
from dtensor3d.models.moe import MoE, expert_matmul, use_grouped_mm

CFG = ModelConfig(hidden_size=16, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)


def make_moe(seed=0, hooks=None):
    torch.manual_seed(seed)
    moe = MoE(CFG, hooks)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


def test_moe_matches_a_per_token_loop():
    """Dropless top-2 routing with normalised weights, computed token by token."""
    moe = make_moe()
    x = torch.randn(3, 5, 16)
    out = moe(x)
    probs = torch.softmax(x.reshape(-1, 16) @ moe.gate.weight.T, dim=-1)
    expected = []
    for t, xt in enumerate(x.reshape(-1, 16)):
        w, idx = probs[t].topk(2)
        w = w / w.sum()
        y = 0
        for wi, e in zip(w, idx):
            h = torch.nn.functional.silu(xt @ moe.experts.w1[e]) * (xt @ moe.experts.w3[e])
            y = y + wi * (h @ moe.experts.w2[e])
        expected.append(y)
    torch.testing.assert_close(out.reshape(-1, 16), torch.stack(expected), rtol=1e-5, atol=1e-5)
    assert int(moe.last_load.sum()) == 15 * 2  # every token routed twice, none dropped


def test_shared_expert_matches_a_per_token_reference():
    """A shared expert (README: model.shared_expert_intermediate_size) beside top-2 routing:
    every token's output is its routed experts' weighted sum plus the shared SwiGLU of the
    token, down(silu(gate x) * up x), with the shared expert's own width. Written token by
    token in plain PyTorch from those words; the forward output, every parameter's gradient
    and the input's (of a fixed random projection of the output) match."""
    cfg = dataclasses.replace(CFG, shared_expert_intermediate_size=12)
    torch.manual_seed(3)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    params = dict(moe.named_parameters())
    assert params["shared_expert.gate_proj.weight"].shape == (12, 16)
    x, probe = torch.randn(2, 5, 16, requires_grad=True), torch.randn(2, 5, 16)
    (moe(x) * probe).sum().backward()
    ours = {n: p.grad.clone() for n, p in params.items()}
    ours["input"], x.grad = x.grad.clone(), None
    ref = {n: p.detach().clone().requires_grad_() for n, p in params.items()}
    outs = []
    for xt in x.reshape(-1, 16):
        probs = torch.softmax(ref["gate.weight"] @ xt, dim=-1)
        w, idx = probs.topk(2)
        y = 0
        for wi, e in zip(w / w.sum(), idx):
            h = torch.nn.functional.silu(xt @ ref["experts.w1"][e]) * (xt @ ref["experts.w3"][e])
            y = y + wi * (h @ ref["experts.w2"][e])
        g = torch.nn.functional.silu(ref["shared_expert.gate_proj.weight"] @ xt)
        outs.append(y + ref["shared_expert.down_proj.weight"] @ (g * (ref["shared_expert.up_proj.weight"] @ xt)))
    expected = torch.stack(outs).reshape(2, 5, 16)
    torch.testing.assert_close(moe(x), expected, rtol=1e-5, atol=1e-5)
    (expected * probe).sum().backward()
    for n in params:
        torch.testing.assert_close(ours[n], ref[n].grad, rtol=1e-4, atol=1e-5, msg=n)
    torch.testing.assert_close(ours["input"], x.grad, rtol=1e-4, atol=1e-5)


def test_balance_loss_is_mixtrals():
    """E * sum_e f_e * P_e with f_e routed slots per token (Hugging Face Mixtral's formula)."""
    moe = make_moe()
    x = torch.randn(2, 6, 16)
    moe(x)
    probs = torch.softmax(x.reshape(-1, 16) @ moe.gate.weight.T, dim=-1)
    chosen = probs.topk(2, dim=-1).indices
    f = torch.nn.functional.one_hot(chosen, 4).float().mean(0).sum(0)
    expected = 4 * (f * probs.mean(0)).sum()
    torch.testing.assert_close(moe.last_aux, expected)


def test_aux_loss_reaches_the_router_through_the_gradient():
    """NeMo Automodel #1412 (the aux loss's gradient not reaching the router): the router's
    gradient from the aux term alone equals autograd's of the formula. The tokens lean towards
    expert 0: with equal loads (f_e = k / E for all e) the loss is constant and its gradient
    is zero, so a lost gradient would pass unseen (it did with plain randn tokens: 2e-8)."""
    moe = make_moe(hooks=ModelHooks(aux_loss_scale=0.5))
    x = torch.randn(2, 6, 16) + moe.gate.weight[0].detach()
    out = moe(x)
    torch.testing.assert_close(out, make_moe()(x))  # the forward output is unchanged
    (out * 0).sum().backward()  # no gradient from the output: the router's is the aux term's alone
    probe = make_moe()
    probs = torch.softmax(x.reshape(-1, 16) @ probe.gate.weight.T, dim=-1)
    f = torch.nn.functional.one_hot(probs.topk(2, dim=-1).indices, 4).float().mean(0).sum(0)
    (0.5 * 4 * (f * probs.mean(0)).sum()).backward()
    assert probe.gate.weight.grad.abs().max() > 0.1  # measured 0.20: a gradient to see
    torch.testing.assert_close(moe.gate.weight.grad, probe.gate.weight.grad)


def test_grouped_mm_equals_loop():
    x = torch.randn(11, 8, requires_grad=True)
    w = torch.randn(3, 8, 12, requires_grad=True)  # rows of 48 bytes: grouped_mm wants 16-byte strides
    counts = [4, 0, 7]
    grads = []
    for grouped in (False, True):
        xi, wi = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        y = expert_matmul(xi, wi, counts, grouped)
        y.sum().backward()  # an expanded (stride-0) gradient
        grads.append((y.detach(), xi.grad, wi.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_grouped_mm_switch_per_device_and_dtype():
    """The experts' switch: the grouped kernel for bf16 on CUDA and fp32 on CPU (16-byte
    aligned rows), the loop for every other device, dtype or alignment."""
    aligned = (32, 48)
    assert use_grouped_mm("cuda", torch.bfloat16, aligned)
    assert use_grouped_mm("cpu", torch.float32, aligned)
    for device, dtype in (("cuda", torch.float32), ("cuda", torch.float16), ("cpu", torch.bfloat16)):
        assert not use_grouped_mm(device, dtype, aligned), (device, dtype)
    assert not use_grouped_mm("mps", torch.float32, aligned)
    assert not use_grouped_mm("cuda", torch.bfloat16, (32, 24))  # a row of 12 bf16 values


def test_grouped_mm_in_bf16_equals_the_loop_on_cpu():
    """What the CUDA branch computes (the grouped kernel in bf16), run by torch's CPU kernel,
    against the loop over the experts in bf16: equal within bf16's rounding (torch's default
    bf16 tolerance), forward and both gradients."""
    x0 = torch.randn(11, 16, generator=torch.Generator().manual_seed(0)).bfloat16()
    w0 = torch.randn(3, 16, 24, generator=torch.Generator().manual_seed(1)).bfloat16()
    counts = [4, 0, 7]
    got = []
    for grouped in (False, True):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = expert_matmul(x, w, counts, grouped)
        y.square().sum().backward()
        got.append((y.detach(), x.grad, w.grad))
    for loop, grouped in zip(*got):
        assert grouped.dtype == torch.bfloat16
        torch.testing.assert_close(grouped, loop)


def test_expert_parallel_dispatch_matches_local():
    out = torchrun(4, ["tests/dist_scripts/ep_dispatch.py"]).stdout
    cases = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert {(c["ep"], c["forced"]) for c in cases} == {(2, False), (2, True), (4, False), (4, True)}
    for c in cases:
        assert max(c["max_errors"]) < 1e-5, c
        assert c["experts_used"] == (2 if c["forced"] else 8), c


def test_tp_ranks_route_half_the_tokens_each():
    """tp 2, both modes: each tp rank sends half the microbatch's token slots to its experts
    (24 tokens x top-2 = 48 on one device, 24 on each rank), and outputs, input gradients,
    parameter gradients (after the tp sum) and the aux loss equal the one-device layer's."""
    out = torchrun(2, ["tests/dist_scripts/tp_token_share.py"]).stdout
    cases = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [c["mode"] for c in cases] == ["ALL_REDUCE", "REDUCE_SCATTER"]
    for c in cases:
        assert c["slots_one_device"] == 2 * 12 * 2, c
        assert c["slots_per_rank"] == [c["slots_one_device"] // 2] * 2, c
        assert max(c["out"], c["dx"], c["params"], c["aux"]) < 1e-5, c


def test_plan_lists_nanotrons_ep_groups():
    """ep is the outermost axis: rank = ((((e * pp + p) * dp + d) * cp + c) * tp + t)."""
    import itertools
    import subprocess
    import sys

    from helpers import ROOT

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dtensor3d",
            "plan",
            "recipes/moe.yaml",
            "--json",
            "parallelism.ep=2",
            "parallelism.pp=2",
            "parallelism.dp=2",
            "parallelism.tp=2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    plan = json.loads(out.stdout)
    ep, pp, dp, cp, tp = 2, 2, 2, 1, 2
    assert plan["world_size"] == 16 and plan["dims"] == {"ep": ep, "pp": pp, "dp": dp, "cp": cp, "tp": tp}
    expected = []
    for p, d, c, t in itertools.product(range(pp), range(dp), range(cp), range(tp)):
        expected.append([(((e * pp + p) * dp + d) * cp + c) * tp + t for e in range(ep)])
    assert sorted(plan["groups"]["ep"]) == sorted(expected)
    assert [0, 8] in plan["groups"]["ep"]


def test_deepseek_router_and_shared_experts_match_transformers():
    """Sigmoid scores + correction bias (for the choice only), 4 groups of which a token may use
    2, top-3, renormalised and scaled by 2.5, two shared experts: our MoE against transformers'
    DeepseekV3MoE with the same (random, bias too) weights."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    keys = dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, n_shared_experts=2, norm_topk_prob=True)
    theirs_cfg = transformers.DeepseekV3Config(
        hidden_size=16, moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=3, **keys
    )
    torch.manual_seed(0)
    theirs = DeepseekV3MoE(theirs_cfg).float()
    for p in [*theirs.parameters(), *theirs.buffers()]:
        torch.nn.init.normal_(p, std=0.3)
    ours = MoE(
        ModelConfig(
            hidden_size=16,
            num_local_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=8,
            scoring_func="sigmoid",
            router_bias_update_rate=1e-3,
            **keys,
        )
    )
    inter = 8
    with torch.no_grad():
        ours.gate.weight.copy_(theirs.gate.weight)
        ours.gate.e_score_correction_bias.copy_(theirs.gate.e_score_correction_bias)
        ours.experts.w1.copy_(theirs.experts.gate_up_proj[:, :inter].transpose(1, 2))
        ours.experts.w3.copy_(theirs.experts.gate_up_proj[:, inter:].transpose(1, 2))
        ours.experts.w2.copy_(theirs.experts.down_proj.transpose(1, 2))
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(ours.shared_expert, name).weight.copy_(getattr(theirs.shared_experts, name).weight)
    x = torch.randn(2, 24, 16)
    with torch.no_grad():
        ref = theirs(x)
        got = ours(x)
        # the bias decides the choice: without it the routing differs
        ours.gate.e_score_correction_bias.zero_()
        unbiased = ours(x)
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    assert (unbiased - ref).abs().max().item() > 1e-3
