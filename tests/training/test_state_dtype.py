"""Issue 41 item 2, optimizer.state_dtype, in this process (no torchrun): the bf16 and 8-bit
state AdamW (training/optim_lowp.py) step equals torchao's optimizer applied directly
(bitwise), and a world-1 run on the trainer's own setup saves the states as they are
(bf16; 8-bit codes with their block scales) and resumes bitwise; and a mesh change, a
1-process 8-bit checkpoint resumed at dp 2 (one 2-rank run). bf16 states resumed at tp 2:
tests/training/test_muon.py's resume test (Muon's momentum and AdamW's moments in bf16)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torchao.optim.adam as torchao_adam
from helpers import PARITY, one_rank_group, train_metrics
from safetensors import safe_open
from torchao.optim import AdamW8bit, _AdamW
from torchao.optim.subclass_8bit import OptimState8bit

from dtensor3d.checkpoint.background import Saver
from dtensor3d.checkpoint.optim_state import load_state
from dtensor3d.checkpoint.slices import SliceReader
from dtensor3d.config.load import load_recipe
from dtensor3d.datasets.sources import make_source
from dtensor3d.training.optim import adamw
from dtensor3d.training.train import rank_batch, setup, train_step

LRS = (1e-2, 7e-3, 3e-3)  # a changing lr, written as floats the way training/train.py writes it


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # a 64 x 128 matrix (8-bit blocks), a 24 x 24 one and biases (fp32 moments)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 24))


def _train(model, opt, set_lr) -> None:
    for i, lr in enumerate(LRS):
        set_lr(opt, lr)
        torch.manual_seed(i)
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A state's stored tensors: torchao's 8-bit codes and block scales, or itself."""
    return (t.codes, t.scale) if isinstance(t, OptimState8bit) else (t,)


@pytest.mark.parametrize("state_dtype", ["bfloat16", "8bit"])
def test_low_precision_state_step_is_torchaos_bitwise(state_dtype, monkeypatch):
    """torchao's own class on the same model and gradients: `_AdamW` with its moments made
    bf16 before the first step (torchtitan's way: torchao keeps them in the weight's dtype),
    `AdamW8bit`; both eager (torch.compile made the identity: on CPU it costs ~14 s a shape).
    Ours: training/optim.py's adamw, groups as the trainer makes them, lr a float per step."""
    opt_cfg = load_recipe(PARITY, [f"optimizer.state_dtype={state_dtype}"]).optimizer
    ours_model, ref_model = _model(), _model()
    ours = adamw(list(ours_model.parameters()), opt_cfg)

    def set_float(opt, lr):
        for g in opt.param_groups:
            g["lr"] = lr

    _train(ours_model, ours, set_float)

    monkeypatch.setattr(torchao_adam.torch, "compile", lambda fn, **kw: fn)
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in ours.param_groups]
    index = {id(p): i for i, p in enumerate(ours_model.parameters())}
    ref_params = list(ref_model.parameters())
    groups = [{**g, "params": [ref_params[index[id(p)]] for p in g["params"]]} for g in groups]
    kw = dict(lr=LRS[0], betas=opt_cfg.betas, eps=opt_cfg.eps)
    ref = _AdamW(groups, **kw) if state_dtype == "bfloat16" else AdamW8bit(groups, **kw)
    if state_dtype == "bfloat16":
        for p in ref_params:
            zero = torch.zeros_like(p, dtype=torch.bfloat16)
            ref.state[p] = {"step": torch.tensor(0.0), "exp_avg": zero, "exp_avg_sq": zero.clone()}
    _train(ref_model, ref, lambda opt, lr: [g["lr"].fill_(lr) for g in opt.param_groups])

    for p, q in zip(ours_model.parameters(), ref_params):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = ours.state[p][key], ref.state[q][key]
            assert type(a) is type(b) and all(torch.equal(x, y) for x, y in zip(_parts(a), _parts(b))), key
    weight = ours.state[ours_model[0].weight]["exp_avg"]
    if state_dtype == "8bit":  # 8 192 elements: codes (1 B each) and 32 fp32 block scales
        assert isinstance(weight, OptimState8bit) and weight.codes.dtype == torch.uint8 and weight.scale.numel() == 32
        assert not isinstance(ours.state[ours_model[2].weight]["exp_avg"], OptimState8bit)  # 3 072 < 4 096
    else:
        assert weight.dtype == torch.bfloat16


@pytest.fixture
def one_rank():
    """A 1-process gloo group (the env torch reads, restored after)."""
    with one_rank_group():
        yield


@pytest.mark.parametrize("state_dtype, optimizer", [("bfloat16", "adamw"), ("8bit", "muon")])
def test_states_saved_as_they_are_and_resumed_bitwise(state_dtype, optimizer, one_rank, tmp_path):
    """Three steps, a save after the second, a resume (checkpoint.resume: auto) that takes
    the third again: loss and every weight bitwise; on disk the moments are bf16, or uint8
    codes beside "<key>_scale" fp32 block scales (muon: the 4 096-element q_proj's momentum
    buffer, 16 blocks; the embedding's AdamW moments, 64)."""
    base = ["model.num_hidden_layers=1", "training.eval_every=0", "training.micro_batch_size=2", "training.steps=3"]
    base += ["training.global_batch_size=2"]  # one microbatch a step
    given = [*base, f"optimizer.state_dtype={state_dtype}", f"optimizer.name={optimizer}"]
    given += [f"checkpoint.dir={tmp_path / 'ck'}"]
    given += ["checkpoint.async_save=false"]
    recipe = load_recipe(PARITY, [*given, "checkpoint.resume=none"])
    state = setup(recipe)
    source = make_source(recipe)
    batches = [rank_batch(state, source, i) for i in range(3)]
    got = []
    for i, batch in enumerate(batches):
        got.append(train_step(state, batch))
        if i == 1:
            step_dir = Saver(state).save(state)
    resumed = setup(load_recipe(PARITY, given))
    assert resumed.step == 2
    if state_dtype == "8bit":  # into fp32 moments (another state_dtype, or blocks a mesh cuts): dequantised
        embed = resumed.model.model.embed_tokens.weight
        held = resumed.optimizer.state[embed]["exp_avg"]
        files = SliceReader(step_dir, json.loads(open(os.path.join(step_dir, "state.json")).read())["tensors"]["optim"])
        plain = torch.empty_like(embed)
        load_state(plain, "model.embed_tokens.weight.exp_avg", files)
        assert isinstance(held, OptimState8bit) and torch.equal(plain, held.dequantize())
    assert train_step(resumed, batches[2])["loss"] == got[2]["loss"]
    for (name, a), b in zip(state.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    index = json.loads((tmp_path / "ck" / "step_00000002" / "state.json").read_text())["tensors"]["optim"]
    q, e = "model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"
    with safe_open(os.path.join(step_dir, index[f"{q}.exp_avg" if optimizer == "adamw" else f"{e}.exp_avg"]
                                ["slices"][0]["file"]), "pt") as f:  # fmt: skip
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    if state_dtype == "8bit":
        assert dtypes[f"{q}.momentum_buffer"] == dtypes[f"{e}.exp_avg_sq"] == "U8", dtypes
        assert dtypes[f"{q}.momentum_buffer_scale"] == dtypes[f"{e}.exp_avg_scale"] == "F32", dtypes
        assert index[f"{q}.momentum_buffer_scale"]["shape"] == [16] and index[f"{e}.exp_avg_scale"]["shape"] == [64]
    else:
        assert dtypes[f"{q}.exp_avg"] == dtypes[f"{q}.exp_avg_sq"] == "BF16", dtypes


def test_8bit_states_resume_at_dp2_within_1e5(one_rank, tmp_path):
    """A mesh change (issue 41: <= 1e-5): a 1-process AdamW8bit run saved after step 2,
    resumed at dp 2 (FSDP's chunks: q_proj's 16 blocks as 8 per rank, the embedding's 64 as
    32, read back from the saved codes and scales), takes steps 3 and 4 as the uninterrupted
    run does; step 4's loss and both grad norms read the resumed 8-bit moments. Measured by
    hand (6 steps, step-3 checkpoint): 1.6e-7 grad norm."""
    base = ["model.num_hidden_layers=1", "training.eval_every=0", "training.steps=4", "training.global_batch_size=2"]
    given = [*base, "optimizer.state_dtype=8bit", f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.async_save=false"]
    recipe = load_recipe(PARITY, [*given, "training.micro_batch_size=2", "checkpoint.resume=none"])
    state, source = setup(recipe), make_source(recipe)
    got = []
    for i in range(4):
        got.append(train_step(state, rank_batch(state, source, i)))
        if i == 1:
            step_dir = Saver(state).save(state)
    mesh = ["parallelism.dp=2", "training.micro_batch_size=1", f"checkpoint.resume={step_dir}"]
    dp2 = train_metrics(tmp_path / "dp2", 2, [*base, "optimizer.state_dtype=8bit", *mesh])
    assert [r["step"] for r in dp2] == [3, 4]
    rel = {
        k: max(abs(r[k] - float(g[k])) / abs(float(g[k])) for r, g in zip(dp2, got[2:])) for k in ("loss", "grad_norm")
    }
    print(f"8bit states, 1 process -> dp 2 at step 2: loss {rel['loss']:.1e}, grad_norm {rel['grad_norm']:.1e}")
    assert max(rel.values()) <= 1e-5, (rel, dp2, got[2:])
