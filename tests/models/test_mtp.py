"""Multi-token prediction (models/mtp.py, training/mtp_loss.py) at one process.

The reference is written here in plain PyTorch from DeepSeek-V3's equations, with
transformers' own LlamaDecoderLayer as the block (our tensors copied into it), embedding first
in the concatenation (as vLLM's deepseek_mtp.py and torchtitan's mtp.py load the released
weights) and h^0 per model.mtp_hidden; a depth k > 1 reads depth k-1's output after its
shared_head.norm. It is not dtensor3d's MTP code.
"""

from __future__ import annotations

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


def test_mtp_dp2_matches_world_1(tmp_path):
    """D = 1 over 6 steps: loss, loss/main, loss/mtp_1 and grad_norm at dp 2 against one process
    (measured: <= 1.7e-7 relative), and loss = loss/main + 0.3 * loss/mtp_1 at every step."""
    from helpers import TOL, short, train_metrics

    overrides = short(["model.num_nextn_predict_layers=1"])
    one = train_metrics(tmp_path / "one", 1, overrides)
    two = train_metrics(tmp_path / "dp2", 2, [*overrides, "parallelism.dp=2"])
    assert len(one) == len(two) == 6
    for a, b in zip(one, two):
        assert abs(a["loss"] - (a["loss/main"] + 0.3 * a["loss/mtp_1"])) <= 1e-6 * a["loss"]
        for key in ("loss", "loss/main", "loss/mtp_1", "grad_norm"):
            assert abs(a[key] - b[key]) <= TOL * abs(a[key]), (key, a[key], b[key])
