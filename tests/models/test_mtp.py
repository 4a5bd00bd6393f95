"""Multi-token prediction (models/mtp.py, training/mtp_loss.py) at one process.

The reference is written here in plain PyTorch from DeepSeek-V3's equations, with
transformers' own LlamaDecoderLayer as the block (our tensors copied into it), embedding first
in the concatenation (as vLLM's deepseek_mtp.py and torchtitan's mtp.py load the released
weights) and h^0 per model.mtp_hidden; a depth k > 1 reads depth k-1's output after its
shared_head.norm. It is not dtensor3d's MTP code.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from dtensor3d.config.schema import ModelConfig
from dtensor3d.errors import RecipeError
from dtensor3d.models.llama import LlamaForCausalLM
from dtensor3d.models.mtp import IGNORE, mtp_targets
from dtensor3d.training.mtp_loss import wrap_loss_fn

TOL = 1e-6


def _model(depth: int, hidden: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = ModelConfig(num_hidden_layers=2, num_nextn_predict_layers=depth, mtp_hidden=hidden)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # every weight away from its init (norms off one, too)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _hf_block(cfg: ModelConfig, ours: torch.nn.Module) -> LlamaDecoderLayer:
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        attn_implementation="eager",
    )
    block = LlamaDecoderLayer(hf_cfg, layer_idx=0)
    block.load_state_dict({k: v for k, v in ours.state_dict().items() if k in block.state_dict()}, strict=True)
    return block, LlamaRotaryEmbedding(hf_cfg)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference(model: LlamaForCausalLM, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each depth's logits, from the equations, with transformers' decoder layer as the block."""
    cfg, inner = model.cfg, model.model
    h = inner.embed_tokens(ids)
    for layer in inner.layers.values():
        h = layer(h)
    normed = inner.norm(h)
    prev = h if cfg.mtp_hidden == "pre_norm" else normed
    s, eps, out = ids.shape[1], cfg.rms_norm_eps, []
    pos = torch.arange(s).unsqueeze(0)
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
    for k, ours in enumerate(inner.mtp.values(), start=1):
        nxt = torch.cat([ids[:, k:], torch.zeros_like(ids[:, :k])], dim=1)  # t_{i+k}
        emb = inner.embed_tokens.weight[nxt]
        x = torch.cat([_rms(emb, ours.enorm.weight, eps), _rms(prev, ours.hnorm.weight, eps)], -1)
        x = x @ ours.eh_proj.weight.T
        block, rotary = _hf_block(cfg, ours)
        x = block(x, attention_mask=mask, position_embeddings=rotary(x, pos), position_ids=pos)
        x = x[0] if isinstance(x, tuple) else x
        prev = _rms(x, ours.shared_head.norm.weight, eps)
        out.append(prev @ model.lm_head.weight.T)
    return out


@pytest.mark.parametrize("depth,hidden", [(1, "pre_norm"), (2, "pre_norm"), (2, "post_norm")])
def test_mtp_logits_match_the_plain_reference(depth, hidden):
    model = _model(depth, hidden)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 12))
    logits = model(ids)  # training forward: [b, s, 1 + D, vocab]
    assert logits.shape == (2, 12, 1 + depth, model.cfg.vocab_size)
    with torch.no_grad():
        main = model(ids)  # validation: the main model alone
        refs = _reference(model, ids)
    assert main.shape == (2, 12, model.cfg.vocab_size)
    assert torch.allclose(logits[:, :, 0], main, atol=1e-6, rtol=0)
    for k, ref in enumerate(refs, start=1):
        err = ((logits[:, :, k] - ref).abs().max() / ref.abs().max()).item()
        assert err <= TOL, f"depth {k}: {err}"


def test_an_mtp_layer_attends_as_the_last_decoder_layer():
    """gpt-oss's layer_types name the decoder's layers only (found by the combination matrix:
    gpt_oss with MTP stopped building at IndexError)."""
    types = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")
    cfg = ModelConfig(
        vocab_size=64, num_hidden_layers=4, sliding_window=6, layer_types=types, num_nextn_predict_layers=1
    )
    assert [cfg.layer_window(i) for i in range(5)] == [6, None, 6, None, None]
    model = LlamaForCausalLM(dataclasses.replace(cfg, layer_types=types[::-1]))
    assert model.model.mtp["4"].self_attn.window == 6 == model.model.layers["3"].self_attn.window


def test_mtp_targets_shift_and_mask():
    targets = torch.tensor([[1, 2, IGNORE, 4, 5, 6]])
    docs = torch.tensor([[0, 0, 0, 0, 1, 1]])
    t = mtp_targets(targets, 2, docs)
    assert t[..., 0].tolist() == targets.tolist()
    # depth 1 at i: targets[i+1], masked past the window, across documents, or where masked
    assert t[..., 1].tolist() == [[2, IGNORE, 4, IGNORE, 6, IGNORE]]
    assert t[..., 2].tolist() == [[IGNORE, 4, IGNORE, IGNORE, IGNORE, IGNORE]]


def test_mtp_loss_is_main_plus_weighted_mean():
    model = _model(2, "pre_norm")
    ids = torch.randint(0, model.cfg.vocab_size, (2, 12))
    targets = torch.randint(0, model.cfg.vocab_size, (2, 12))
    glob = 24

    def main_fn(logits, tgt):
        return F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="sum") / glob

    parts: list = []
    loss = wrap_loss_fn(main_fn, model.cfg, glob, parts)(model(ids), mtp_targets(targets, 2))
    main, ce1, ce2 = parts[0].tolist()
    logits = model(ids)
    want1 = F.cross_entropy(logits[:, :-1, 1].flatten(0, 1), targets[:, 1:].flatten(), reduction="sum") / glob
    assert abs(ce1 - want1.item()) <= 1e-6 * want1.item()
    assert abs(loss.item() - (main + 0.3 / 2 * (ce1 + ce2))) <= 1e-6 * loss.item()


@pytest.mark.parametrize(
    "overrides,needle",
    [
        ({"num_nextn_predict_layers": -1}, "model.num_nextn_predict_layers=-1"),
        ({"mtp_loss_weight": -0.5}, "model.mtp_loss_weight=-0.5"),
        ({"num_nextn_predict_layers": 64}, "training.sequence_length=64"),
    ],
)
def test_mtp_door_errors(overrides, needle):
    import dataclasses

    from dtensor3d.config.mtp_checks import validate_mtp
    from dtensor3d.config.schema import Recipe

    recipe = Recipe()
    recipe = dataclasses.replace(
        recipe,
        model=dataclasses.replace(recipe.model, **overrides),
        training=dataclasses.replace(recipe.training, sequence_length=64),
    )
    with pytest.raises(RecipeError, match=needle.replace(".", r"\.")):
        validate_mtp(recipe)


def test_mtp_dp2_matches_world_1_and_resumes_at_pp2(tmp_path):
    """D = 1 with tied embeddings over 6 steps: loss, loss/main, loss/mtp_1 and grad_norm at
    dp 2 against one process (measured: <= 1.7e-7 relative), loss = loss/main + 0.3 *
    loss/mtp_1 at every step; then dp 2's step-3 checkpoint resumed at pp 2 zbv gives the
    uninterrupted steps 4-6 within the parity bar: rank 0 holds the first stage and the last,
    with three copies of the tied matrix (the embedding, and the last stage's head and MTP
    copy, two parameters under a split backward: parallel/tied.py's `copies`), each read from
    the checkpoint, their gradients summed and each counted 1/3 in the grad norm (it was 1/2
    each: grad_norm 11% off; measured now <= 8.5e-8)."""
    from helpers import TOL, short, train_metrics

    overrides = short(["model.num_nextn_predict_layers=1", "model.tie_word_embeddings=true"])
    one = train_metrics(tmp_path / "one", 1, overrides)
    saves = [f"checkpoint.dir={tmp_path}/ck", "checkpoint.interval=3"]
    two = train_metrics(tmp_path / "dp2", 2, [*overrides, "parallelism.dp=2", *saves])
    pp = ["parallelism.pp=2", "parallelism.pp_engine=zbv", "training.micro_batch_size=1"]
    unbatched = [o for o in overrides if not o.startswith("training.micro_batch_size")]
    resume = f"checkpoint.resume={tmp_path}/ck/step_00000003"
    resumed = train_metrics(tmp_path / "pp2", 2, [*unbatched, *pp, resume])
    assert len(one) == len(two) == 6 and [r["step"] for r in resumed] == [4, 5, 6]
    for a, b in zip(one, two):
        assert abs(a["loss"] - (a["loss/main"] + 0.3 * a["loss/mtp_1"])) <= 1e-6 * a["loss"]
        for key in ("loss", "loss/main", "loss/mtp_1", "grad_norm"):
            assert abs(a[key] - b[key]) <= TOL * abs(a[key]), (key, a[key], b[key])
    for a, b in zip(one[3:], resumed):
        for key in ("loss", "loss/main", "loss/mtp_1", "grad_norm"):
            assert abs(a[key] - b[key]) <= TOL * abs(a[key]), ("resumed at pp 2", b["step"], key, a[key], b[key])


# ---------------------------------------------------------------- DeepSeek-V3's checkpoint layout

DSV3 = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=123456.0,
    tie_word_embeddings=False,
    kv_lora_rank=20,
    qk_nope_head_dim=12,
    qk_rope_head_dim=8,
    v_head_dim=10,
    first_k_dense_replace=1,  # layer 0 dense, layer 1 and the MTP blocks with experts
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
)


# GLM-4.5 (transformers' Glm4MoeForCausalLM): its MTP layers have DeepSeek-V3's layout
# (vLLM's glm4_moe_mtp.py; transformers skips model.layers.{N}.*): RoPE on half of each head,
# q/k/v biases, per-head q/k norms, sigmoid routing, layer 0 dense.
GLM = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    attention_bias=True,
    use_qk_norm=True,
    first_k_dense_replace=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
)


def _classes(family: str):
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer

    if family == "glm4_moe":
        return transformers.Glm4MoeConfig(**GLM), transformers.Glm4MoeForCausalLM, Glm4MoeDecoderLayer
    return transformers.DeepseekV3Config(**DSV3), transformers.DeepseekV3ForCausalLM, DeepseekV3DecoderLayer


def _dsv3_dir(root, depth: int, family: str = "deepseek_v3"):
    """transformers' DeepseekV3ForCausalLM (or GLM-4.5's class), every weight perturbed, plus MTP
    tensors under the released names (random, away from their init): the block of each depth is a
    DeepseekV3DecoderLayer's own state dict. Returns (hf model, {k: (block, enorm, hnorm, eh, norm)})."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    cfg, model_cls, DeepseekV3DecoderLayer = _classes(family)
    cfg.num_nextn_predict_layers = depth
    hf = model_cls(cfg).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(root)
    tensors, mods = load_file(root / "model.safetensors"), {}
    for k in range(1, depth + 1):
        i = cfg.num_hidden_layers + k - 1
        block = DeepseekV3DecoderLayer(cfg, layer_idx=i).float().eval()
        extra = {n: 1 + 0.1 * torch.randn(64) for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")}
        extra["eh_proj.weight"] = torch.randn(64, 128) * 0.05
        with torch.no_grad():  # a block built alone holds uninitialised memory: every value set here
            for n, p in block.named_parameters():
                p.copy_(
                    (1.0 if n.endswith("norm.weight") else 0.0) + torch.randn_like(p) * (0.1 if p.ndim == 1 else 0.05)
                )
        extra |= _per_expert({n: t.detach().clone() for n, t in block.state_dict().items()})
        extra["embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        extra["shared_head.head.weight"] = tensors["lm_head.weight"].clone()
        tensors |= {f"model.layers.{i}.{n}": t.contiguous() for n, t in extra.items()}
        mods[k] = (block, extra)
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    return hf, mods


def _per_expert(state: dict) -> dict:
    """transformers 5's fused expert tensors (gate_up_proj [E, 2I, H], gate first; down_proj
    [E, H, I]) as the checkpoint's per-expert names, which save_pretrained writes."""
    gate_up, down = state.pop("mlp.experts.gate_up_proj"), state.pop("mlp.experts.down_proj")
    inner = down.shape[2]
    for e in range(down.shape[0]):
        state[f"mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :inner]
        state[f"mlp.experts.{e}.up_proj.weight"] = gate_up[e, inner:]
        state[f"mlp.experts.{e}.down_proj.weight"] = down[e]
    return state


def _dsv3_reference(hf, mods, ids, targets, hidden: str) -> list[float]:
    """Each depth's mean CE (over the positions with a target k+1 ahead), from the equations with
    transformers' DeepseekV3DecoderLayer as the block; embedding first in the concatenation."""
    kept = []
    hook = hf.model.layers[-1].register_forward_hook(
        lambda m, a, out: kept.append(out[0] if isinstance(out, tuple) else out)
    )
    out = hf.model(ids).last_hidden_state  # after the final norm
    hook.remove()
    prev = kept[0] if hidden == "pre_norm" else out
    s, eps, losses = ids.shape[1], hf.config.rms_norm_eps, []
    pos = torch.arange(s).unsqueeze(0)
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
    for k, (block, t) in mods.items():
        nxt = torch.cat([ids[:, k:], torch.zeros_like(ids[:, :k])], dim=1)
        emb = hf.model.embed_tokens.weight[nxt]
        x = (
            torch.cat([_rms(emb, t["enorm.weight"], eps), _rms(prev, t["hnorm.weight"], eps)], -1)
            @ t["eh_proj.weight"].T
        )
        x = block(x, attention_mask=mask, position_embeddings=hf.model.rotary_emb(x, pos), position_ids=pos)
        x = x[0] if isinstance(x, tuple) else x
        prev = _rms(x, t["shared_head.norm.weight"], eps)
        logits = prev @ hf.lm_head.weight.T
        losses.append(F.cross_entropy(logits[:, : s - k].flatten(0, 1), targets[:, k:].flatten()).item())
    return losses


@pytest.mark.parametrize("depth,family", [(1, "deepseek_v3"), (2, "deepseek_v3"), (1, "glm4_moe")])
def test_deepseek_v3_mtp_layers_against_transformers(tmp_path, depth, family):
    """import-hf of a DeepSeek-V3 directory with MTP layers: the main loss equals transformers'
    and each depth's loss the plain reference (<= 1e-6 relative); export-hf writes every tensor
    back under its name, the MTP layers' embedding/head copies (the main model's) included."""
    from safetensors.torch import load_file

    from dtensor3d.__main__ import main
    from dtensor3d.checkpoint import load_model

    hf, mods = _dsv3_dir(tmp_path / "hf", depth, family)
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ck")]) == 0
    ours = load_model(tmp_path / "ck").train()
    assert ours.cfg.num_nextn_predict_layers == depth
    gen = torch.Generator().manual_seed(1)
    ids, targets = torch.randint(0, 256, (2, 24), generator=gen), torch.randint(0, 256, (2, 24), generator=gen)
    logits = ours(ids)
    with torch.no_grad():
        ref_main = F.cross_entropy(hf(ids).logits.flatten(0, 1), targets.flatten()).item()
        refs = _dsv3_reference(hf, mods, ids, targets, "pre_norm")
    main_loss = F.cross_entropy(logits[:, :, 0].flatten(0, 1), targets.flatten()).item()
    assert all(hasattr(layer, "block_sparse_moe") for layer in ours.model.mtp.values())  # its own experts
    assert abs(main_loss - ref_main) <= 1e-6 * ref_main, (main_loss, ref_main)
    for k, ref in enumerate(refs, start=1):
        got = F.cross_entropy(logits[:, : 24 - k, k].flatten(0, 1), targets[:, k:].flatten()).item()
        print(f"depth {k}: loss/mtp {got} reference {ref} rel {abs(got - ref) / ref:.2e}")
        assert abs(got - ref) <= 1e-6 * ref, (k, got, ref)
    print(f"main: {main_loss} transformers {ref_main} rel {abs(main_loss - ref_main) / ref_main:.2e}")
    assert main(["export-hf", str(tmp_path / "ck"), str(tmp_path / "out")]) == 0
    back, given = load_file(tmp_path / "out" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert set(back) == set(given)
    assert all(torch.equal(back[n], given[n]) for n in given)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == depth
    import transformers  # transformers still loads the export (it ignores the MTP layers): the same main logits

    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(again(ids).logits, hf(ids).logits, rtol=0, atol=1e-6)


def test_deepseek_v3_mtp_copy_of_the_embedding_must_equal_the_main_one(tmp_path, capsys):
    """An MTP layer's embed_tokens that is not the main model's: import-hf refuses it in one line."""
    from safetensors.torch import load_file, save_file

    from dtensor3d.__main__ import main

    _dsv3_dir(tmp_path / "hf", 1)
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors["model.layers.2.embed_tokens.weight"] = tensors["model.layers.2.embed_tokens.weight"] + 1
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ck")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "model.layers.2.embed_tokens.weight (not model.embed_tokens.weight)" in err[0]


def test_mtp_ep2_matches_world_1(tmp_path):
    """D = 1 on the MoE parity recipe (the MTP block has its own experts, sharded over ep like
    the others): ep 2 against one process over 6 steps (measured: <= 1.8e-7 relative)."""
    from helpers import ROOT, TOL, short, train_metrics

    moe, overrides = str(ROOT / "tests" / "recipes" / "moe_parity.yaml"), short(["model.num_nextn_predict_layers=1"])
    one = train_metrics(tmp_path / "one", 1, overrides, recipe=moe)
    two = train_metrics(tmp_path / "ep2", 2, [*overrides, "parallelism.ep=2"], recipe=moe)
    assert len(one) == len(two) == 6
    for a, b in zip(one, two):
        for key in ("loss", "loss/main", "loss/mtp_1", "grad_norm", "aux_loss"):
            assert abs(a[key] - b[key]) <= TOL * abs(a[key]), (key, a[key], b[key])


def test_export_of_a_family_without_mtp_layers_writes_them_with_one_note(tmp_path):
    """A Llama with an MTP module: export-hf writes it under DeepSeek-V3's names (model.layers.{N}.*)
    and prints one note: line (transformers' Llama ignores them)."""
    from helpers import PARITY, cli, cli_process
    from safetensors.torch import load_file

    run = ["training.steps=1", "model.num_nextn_predict_layers=1", f"logging.run_dir={tmp_path / 'run'}"]
    args = ["train", PARITY, *run, f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.interval=1"]
    assert cli_process(*args).returncode == 0
    out = cli("export-hf", str(tmp_path / "ck"), str(tmp_path / "hf"))
    assert out.returncode == 0, out.stderr
    notes = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "model.layers.4" in notes[0] and "ignores them" in notes[0], notes
    names = set(load_file(tmp_path / "hf" / "model.safetensors"))
    assert {f"model.layers.4.{n}.weight" for n in ("eh_proj", "enorm", "hnorm", "shared_head.norm")} <= names
