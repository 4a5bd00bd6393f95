"""optimizer.name=muon in one process, against torch.optim.Muon itself: the same gradients
give bitwise the same weights (each stacked expert orthogonalised alone, as the Linear
weight [out, in] a Hugging Face model holds), and the split of item 1 (which parameters are
Muon's). Meshes: the combination matrix's optimizer.name option (tests/parallel/matrix.py)."""

from __future__ import annotations

import json

import torch
from helpers import PARITY, ROOT, cli, one_error_line, torchrun, train_metrics
from safetensors import safe_open

from dtensor3d.config.load import load_recipe
from dtensor3d.models import build_on_meta, materialize
from dtensor3d.parallel.shards import init_weights
from dtensor3d.training.muon import MuonAdamW
from dtensor3d.training.optim import build_optimizer

OVERRIDES = [
    "optimizer.name=muon",
    "optimizer.muon_lr=0.02",
    "optimizer.weight_decay=0.2",
    "optimizer.muon_adjust_lr=original",
    "model.num_hidden_layers=2",
]


def model_and_optimizer(recipe_name: str):
    recipe = load_recipe(str(ROOT / "tests" / "recipes" / recipe_name), OVERRIDES)
    model = materialize(build_on_meta(recipe.model), torch.device("cpu"))
    init_weights(model, 0)
    return recipe, model, build_optimizer([model], recipe.optimizer)


def test_muon_matrices_are_the_decoder_layers_matrices():
    _, model, opt = model_and_optimizer("deepseek_parity.yaml")
    assert isinstance(opt, MuonAdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in opt.param_groups if g.get("muon") for p in g["params"]}
    rest = {names[id(p)] for g in opt.param_groups if not g.get("muon") for p in g["params"]}
    assert "model.layers.0.self_attn.kv_b_proj.weight" in muon and "model.layers.1.block_sparse_moe.experts.w2" in muon
    assert "model.layers.1.block_sparse_moe.shared_expert.down_proj.weight" in muon
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.1.block_sparse_moe.gate.weight"} <= rest
    assert "model.layers.0.self_attn.kv_a_layernorm.weight" in rest and not muon & rest
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert muon | rest == trained  # the router's correction bias (no gradient) is in neither


def test_update_is_torch_muon_bitwise():
    """3 steps on the same random gradients: every Muon matrix equal to torch.optim.Muon's (an
    expert's [in, out] slice against torch's update of its transpose), the rest to AdamW's."""
    recipe, model, opt = model_and_optimizer("moe_parity.yaml")
    o = recipe.optimizer
    muon_ids = {id(p) for g in opt.param_groups if g.get("muon") for p in g["params"]}
    copies, torch_muon, rest = {}, [], []
    for name, p in model.named_parameters():
        if id(p) in muon_ids and p.ndim == 3:  # E Linear weights [out, in]
            copies[name] = [torch.nn.Parameter(p.detach()[e].T.clone()) for e in range(p.shape[0])]
            torch_muon += copies[name]
        else:
            copies[name] = [torch.nn.Parameter(p.detach().clone())]
            (torch_muon if id(p) in muon_ids else rest).extend(copies[name])
    ref_muon = torch.optim.Muon(
        torch_muon, lr=o.muon_lr, weight_decay=o.weight_decay, momentum=o.muon_momentum, adjust_lr_fn="original"
    )
    decay = [q for q in rest if q.ndim >= 2]
    ref_adamw = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": o.weight_decay},
            {"params": [q for q in rest if q.ndim < 2], "weight_decay": 0},
        ],
        lr=o.lr,
        betas=o.betas,
        eps=o.eps,
    )
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        for name, p in model.named_parameters():
            p.grad = torch.randn(p.shape, generator=gen) * 0.01
            per_expert = p.ndim == 3 and id(p) in muon_ids
            for e, q in enumerate(copies[name]):
                q.grad = p.grad[e].T.clone() if per_expert else p.grad.clone()
        for group in opt.param_groups:
            group["lr"] = o.lr * (step + 1) / 3 * group.get("lr_scale", 1.0)
        for group in ref_adamw.param_groups:
            group["lr"] = o.lr * (step + 1) / 3
        for group in ref_muon.param_groups:
            group["lr"] = o.muon_lr * (step + 1) / 3
        opt.step()
        ref_muon.step()
        ref_adamw.step()
    for name, p in model.named_parameters():
        if id(p) in muon_ids and p.ndim == 3:
            got = [p.detach()[e].T for e in range(p.shape[0])]
        else:
            got = [p.detach()]
        for g, q in zip(got, copies[name]):
            assert torch.equal(g, q.detach()), name


# with optimizer.state_dtype bfloat16 (issue 41: the states saved as they are, resumed bitwise on
# the same mesh and within 1e-5 on another): Muon's momentum and the other parameters' AdamW moments
MUON_RUN = [
    "optimizer.name=muon",
    "optimizer.muon_adjust_lr=match_rms_adamw",
    "training.steps=5",
    "optimizer.state_dtype=bfloat16",
]


def test_muon_resumes_bitwise_on_its_mesh_and_on_tp2(shared_run, tmp_path):
    """Muon's momentum buffers are checkpointed like AdamW's moments ("<param>.momentum_buffer"),
    here in bf16 (optimizer.state_dtype) with the AdamW parameters' moments: a 1-process run
    saved at step 3 continues bitwise in one process and within 1e-5 at tp 2 (the bf16 buffers
    resharded over column and row shards: step 5's loss moves with step 4's momentum). Two
    steps: past them, tp's ~1e-7 in the gradients grows through bf16 Newton-Schulz (measured
    with fp32 states: grad_norm 2.3e-5 by step 6; the combination matrix's muon bars).
    Switching optimizer.name on that resume is one error line at the door."""
    records, root = shared_run(1, [*MUON_RUN, "checkpoint.dir={root}/ck", "checkpoint.interval=3"])
    step = root / "ck" / "step_00000003"
    index = json.loads((step / "state.json").read_text())["tensors"]["optim"]
    buffer = "model.layers.0.mlp.down_proj.weight.momentum_buffer"
    with safe_open(str(step / index[buffer]["slices"][0]["file"]), "pt") as f:
        assert f.get_slice(buffer).get_dtype() == "BF16"  # saved as it is
    same = train_metrics(tmp_path / "one", 1, [*MUON_RUN, f"checkpoint.resume={step}"])
    assert [(r["loss"], r["grad_norm"]) for r in same] == [(r["loss"], r["grad_norm"]) for r in records[3:]]
    tp2 = train_metrics(tmp_path / "tp2", 2, [*MUON_RUN, "parallelism.tp=2", f"checkpoint.resume={step}"])
    for g, r in zip(tp2, records[3:], strict=True):
        assert (
            abs(g["loss"] - r["loss"]) <= 1e-5 * r["loss"]
            and abs(g["grad_norm"] - r["grad_norm"]) <= 1e-5 * r["grad_norm"]
        ), (g, r)
    line = one_error_line(cli("validate", str(PARITY), "training.steps=5", f"checkpoint.resume={step}"))
    assert "optimizer.name='muon'" in line and "'adamw'" in line


def test_owner_exchange_is_torch_newton_schulz_bitwise_on_every_layout():
    """4 ranks as a 2 x 2 mesh: FSDP's Shard(0) (uneven), tp's column and row shards, FSDP over
    tp (_StridedShard), HSDP's Replicate x Shard, experts over ep with FSDP inside, a plain
    tensor: each local piece of the owner's orthogonalised update is torch's Newton-Schulz of
    the full matrix, bit for bit, in bf16 (torch's) and in fp32 (optimizer.muon_ns_dtype)
    (tests/dist_scripts/muon_exact.py). End to end, a mesh's gradients differ from one
    process's in the order of their sums (~1e-7), which bf16 Newton-Schulz turns into 2e-5 to
    1e-3 by step 6, fp32 keeps at ~2e-7 (the combination matrix's muon runs, in fp32)."""
    out = torchrun(4, ["tests/dist_scripts/muon_exact.py"]).stdout
    assert "MUON EXACT 8 torch.bfloat16" in out and "MUON EXACT 8 torch.float32" in out, out[-2000:]
    assert "DIFFERENT" not in out


def test_newton_schulz_bf16_is_torchs_bitwise_and_fp32_is_torchs_algorithm_in_fp64():
    """muon_owners.zeropower at bfloat16 is torch's `_zeropower_via_newtonschulz` bit for bit
    (wide, tall, square); at float32 (optimizer.muon_ns_dtype) it is torch's own source run in
    float64 (its one bf16 cast made a float64 one) to 2e-6, where bf16 is ~1e-2 from it."""
    import inspect

    from torch.optim import _muon

    from dtensor3d.training.muon_owners import zeropower

    source = inspect.getsource(_muon._zeropower_via_newtonschulz)
    assert source.count("grad.bfloat16()") == 1
    scope: dict = {}
    exec(source.replace("grad.bfloat16()", "grad.double()"), dict(vars(_muon)), scope)
    coefficients = (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C)
    gen = torch.Generator().manual_seed(0)
    for shape in [(64, 24), (24, 64), (40, 40), (96, 17)]:
        g = torch.randn(shape, generator=gen) * 0.01
        torch_bf16 = _muon._zeropower_via_newtonschulz(g, coefficients, 5, _muon.EPS)
        assert torch.equal(zeropower(g, torch.bfloat16, 5), torch_bf16), shape
        in_fp64 = scope["_zeropower_via_newtonschulz"](g.double(), coefficients, 5, _muon.EPS)
        ours = zeropower(g, torch.float32, 5)
        assert ours.dtype == torch.float32 and (ours.double() - in_fp64).abs().max() <= 2e-6, shape
        assert (torch_bf16.double() - in_fp64).abs().max() > 1e-3  # the rounding float32 takes away
