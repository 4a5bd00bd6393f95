"""Model families (llama with Llama 3.1 RoPE scaling, qwen2, qwen3, mistral, qwen3_moe): a tiny random
transformers model of each, every parameter moved away from its init (biases and norm weights
too) and rope_theta not 10000, gives our logits (load_model on its directory) to 1e-5
relative; import-hf -> export-hf loads back into AutoModelForCausalLM with no missing or
unexpected keys and the same logits; greedy generation with our KV cache equals transformers'
generate(do_sample=False) token for token. In-process, about a second per family."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dtensor3d.__main__ import main
from dtensor3d.checkpoint import load_model
from dtensor3d.generate import generate_ids

transformers = pytest.importorskip("transformers")

BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=123456.0,
    tie_word_embeddings=False,
)
LLAMA3_ROPE = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
)
MLA = dict(
    num_key_value_heads=4,
    kv_lora_rank=20,
    qk_nope_head_dim=12,
    qk_rope_head_dim=8,
    v_head_dim=10,
    first_k_dense_replace=2,
)
NO_TOKENS = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)  # defaults past the tiny vocabulary
FAMILIES = {
    # family: (config class, extra config, what must show in the parameter names)
    "llama3": (
        "LlamaConfig",
        dict(rope_parameters={**LLAMA3_ROPE, "rope_theta": 123456.0}, attention_bias=True, mlp_bias=True),
        "mlp.down_proj.bias",
    ),
    "llama_yarn": (
        "LlamaConfig",
        dict(
            rope_parameters=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=32, rope_theta=123456.0)
        ),
        "o_proj.weight",
    ),
    "qwen2": ("Qwen2Config", {}, "q_proj.bias"),
    "qwen3": ("Qwen3Config", dict(head_dim=24), "k_norm.weight"),
    "mistral": ("MistralConfig", dict(sliding_window=None), "o_proj.weight"),
    # Sliding windows shorter than the sequence (64) and than generation (2 x 12 < 40 new
    # tokens): on every layer (Mistral), and on the layers from max_window_layers on (Qwen2).
    "mistral_window": ("MistralConfig", dict(sliding_window=12), "o_proj.weight"),
    "qwen2_window": (
        "Qwen2Config",
        dict(use_sliding_window=True, sliding_window=12, max_window_layers=1),
        "q_proj.bias",
    ),
    # OLMo 2: norms after attention and the MLP (none before), q/k norms over the whole projection
    "olmo2": ("Olmo2Config", dict(attention_bias=True), "post_feedforward_layernorm.weight"),
    # OLMo 3: OLMo 2's and sliding layers (layer_types: layer 1 full, 0 and 2 sliding)
    "olmo3": (
        "Olmo3Config",
        dict(num_hidden_layers=3, sliding_window=12, **NO_TOKENS),
        "post_feedforward_layernorm.weight",
    ),
    # Gemma 3: the embedding times sqrt(hidden), x·(1+w) norms before and after attention and
    # the MLP, GeGLU, query_pre_attn_scalar 20 (not head_dim 16), per-head q/k norms, layers 0
    # and 2 sliding (window 12) with their own RoPE base, tied embeddings
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=3,
            head_dim=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=12,
            query_pre_attn_scalar=20,
            rope_local_base_freq=777.0,
            tie_word_embeddings=True,
        ),
        "pre_feedforward_layernorm.weight",
    ),
    # Phi-3: q/k/v fused into qkv_proj and gate/up into gate_up_proj in the checkpoint; a window on every layer
    "phi3": ("Phi3Config", dict(sliding_window=12, **NO_TOKENS), "self_attn.qkv_proj.weight"),
    # GLM-4.5: RoPE on half of each head (partial_rotary_factor), q/k/v biases without o's, per-head
    # q/k norms (use_qk_norm), DeepSeek-V3's routing (sigmoid, correction bias, top-3 of 8 in 2 of 4
    # groups, scaling 2.5, 2 shared experts), layer 0 dense
    "glm4_moe": (
        "Glm4MoeConfig",
        dict(
            head_dim=24,
            attention_bias=True,
            use_qk_norm=True,
            partial_rotary_factor=0.5,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=3,
            moe_intermediate_size=24,
            n_shared_experts=2,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            **NO_TOKENS,
        ),
        "mlp.shared_experts.gate_proj.weight",
    ),
    # SmolLM3: layer 1 without RoPE (no_rope_layers), tied embeddings, biases
    "smollm3": (
        "SmolLM3Config",
        dict(no_rope_layers=[1, 0], tie_word_embeddings=True, attention_bias=True, mlp_bias=True, **NO_TOKENS),
        "mlp.up_proj.bias",
    ),
    # multi-head latent attention: low-rank q, interleaved RoPE part, YaRN with both mscales
    # (softmax scale too), v_head_dim != qk width; layer 0 dense, layer 1 experts: sigmoid
    # scores + the correction bias, top-3 of 8 in 2 of 4 groups, scaling 2.5, 2 shared experts
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            **{**MLA, "first_k_dense_replace": 1},
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=3,
            moe_intermediate_size=24,
            n_shared_experts=2,
            routed_scaling_factor=2.5,
            q_lora_rank=24,
            rope_parameters=dict(
                rope_type="yarn",
                factor=8.0,
                original_max_position_embeddings=32,
                mscale=0.9,
                mscale_all_dim=1.1,
                rope_theta=123456.0,
            ),
        ),
        "mlp.shared_experts.gate_proj.weight",
    ),
    # gpt-oss: a learned sink logit per head, layers 0 and 2 sliding (window 12), YaRN (truncate off),
    # attention biases, 4 experts with biases (gate/up interleaved in gate_up_proj), router bias,
    # softmax over the top-2 logits, the SwiGLU clamped at 1.5 (reached by the random weights)
    "gpt_oss": (
        "GptOssConfig",
        dict(
            num_hidden_layers=3,
            head_dim=16,
            sliding_window=12,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=24,
            swiglu_limit=1.5,
            rope_parameters=dict(
                rope_type="yarn",
                factor=8.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=32,
                rope_theta=123456.0,
            ),
            **NO_TOKENS,
        ),
        "self_attn.sinks",
    ),
    # The head tied to the embedding (Qwen2's small models ship so): one tensor in the file.
    "qwen2_tied": ("Qwen2Config", dict(tie_word_embeddings=True), "q_proj.bias"),
    # layer 0 sparse, layer 1 dense (mlp_only_layers); softmax top-2 of 4 without renormalising
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(head_dim=24, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, mlp_only_layers=[1]),
        "mlp.experts.gate_up_proj",
    ),
}


def relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers model, its directory, our checkpoint from import-hf, export-hf of it)."""
    root = tmp_path_factory.mktemp(request.param)
    config_cls, extra, must_have = FAMILIES[request.param]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_cls)(**{**BASE, **extra}))
    hf = hf.float().eval()
    names = [n for n, _ in hf.named_parameters()]
    assert any(n.endswith(must_have) for n in names), names
    with torch.no_grad():
        for p in hf.parameters():  # biases off zero, norms off one: each tensor distinct
            p.add_(torch.randn_like(p) * 0.1)
        for name, b in hf.named_buffers():  # DeepSeek-V3's routing correction bias (saved state)
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.3)
    hf.save_pretrained(root / "hf")
    assert main(["import-hf", str(root / "hf"), str(root / "ck")]) == 0
    assert main(["export-hf", str(root / "ck"), str(root / "export")]) == 0
    return request.param, hf, root


def test_logits_equal_transformers(family):
    _, hf, root = family
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))  # past 16 and 32 positions
    with torch.no_grad():
        ref = hf(ids).logits
        assert relative(load_model(root / "hf")(ids), ref) <= 1e-5
        assert relative(load_model(root / "ck")(ids), ref) <= 1e-5


# The families whose attention differs in what positions do: llama3 and yarn RoPE scalings,
# Qwen3's per-head q/k norms and head_dim (qwen2 and mistral attend as llama does).
@pytest.mark.parametrize(
    "family", ["llama3", "llama_yarn", "qwen3", "deepseek_v3", "qwen2_window", "gpt_oss"], indirect=True
)
def test_packed_documents_equal_each_document_alone(family):
    # Two windows of a packed stream (documents of 1 to 45 tokens, the first window starting
    # inside one): the positions and document ids data.document_masking gives them (the
    # data path's own window_documents), our model's per-token losses against transformers
    # running each document's part of the window alone (positions from 0).
    from dtensor3d.datasets.tokens import window_documents

    _, hf, root = family
    stream = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(3))
    offsets = np.array([0, 7, 8, 30, 31, 45, 90, 120, 200])
    starts, length = (3, 40), 64
    ids = torch.stack([stream[s : s + length] for s in starts])
    targets = torch.stack([stream[s + 1 : s + length + 1] for s in starts])
    positions, documents = (
        torch.stack(t)[:, :length] for t in zip(*(window_documents(offsets, s, 65) for s in starts))
    )
    assert positions[0, :4].tolist() == [0, 1, 2, 3] and positions[0, 4:6].tolist() == [0, 0]
    ours = load_model(root / "ck")
    with torch.no_grad():
        logits = ours(ids, position_ids=positions, document_ids=documents)
        got = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(2, length)
        want = torch.empty_like(got)
        for b, s in enumerate(starts):
            edges = sorted({0, length, *(int(o) - s for o in offsets if 0 < o - s < length)})
            for i, j in zip(edges, edges[1:]):  # each document's part of the window, alone
                alone = hf(ids[b : b + 1, i:j]).logits[0]
                want[b, i:j] = F.cross_entropy(alone, targets[b, i:j], reduction="none")
        plain = F.cross_entropy(ours(ids).flatten(0, 1), targets.flatten(), reduction="none")
    assert len(edges) >= 4  # documents inside each window
    assert (got - want).abs().max() <= 1e-5, (got - want).abs().max()
    assert (plain.view(2, length) - want).abs().max() > 0.01  # unmasked, the documents see each other


def test_export_loads_in_transformers_in_the_family(family):
    name, hf, root = family
    config = json.loads((root / "export" / "config.json").read_text())
    assert config["model_type"] == hf.config.model_type
    assert config["architectures"] == [type(hf).__name__]
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        root / "export", output_loading_info=True, dtype=torch.float32
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(back) is type(hf)
    tied = hf.config.tie_word_embeddings
    assert config.get("tie_word_embeddings", False) == tied
    shared = back.get_output_embeddings().weight.data_ptr() == back.get_input_embeddings().weight.data_ptr()
    assert shared == tied
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(2))
    # ...and import-hf of what transformers saved back: the round trip closes.
    back.save_pretrained(root / "resaved")
    assert main(["import-hf", str(root / "resaved"), str(root / "ck2")]) == 0
    with torch.no_grad():
        assert relative(back.eval()(ids).logits, hf(ids).logits) <= 1e-5
        assert relative(load_model(root / "ck2")(ids), hf(ids).logits) <= 1e-5


def test_greedy_generate_equals_transformers(family):
    _, hf, root = family
    ours = load_model(root / "ck")
    for prompt in ([5, 17, 200, 3], [100]):
        got = list(generate_ids(ours, prompt, 40, temperature=0.0))
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None)
        assert got == theirs[0, len(prompt) :].tolist()


def test_window_masks_what_transformers_masks():
    """The windowed families' logits differ from full attention's (the window is in force),
    and a window of w + 1 differs from w (transformers' off-by-one: i - w < j <= i)."""
    config = transformers.MistralConfig(**BASE, sliding_window=12)
    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM(config).eval()
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids).logits
        for window, equal in ((12, True), (13, False), (11, False), (None, False)):
            ours = load_model_from(hf, window)
            assert (relative(ours(ids), ref) <= 1e-5) == equal, window


def load_model_from(hf, window):
    """Our model with hf's weights and config, its window replaced."""
    import dataclasses

    from dtensor3d.checkpoint.hf import config_from_hf
    from dtensor3d.models.llama import LlamaForCausalLM

    cfg = dataclasses.replace(config_from_hf(hf.config.to_dict(), "config"), sliding_window=window)
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(hf.state_dict())
    return model.eval()


def test_rope_read_in_both_spellings():
    """transformers 5's rope_parameters and 4's rope_theta + rope_scaling (with 4's `type`) give one config."""
    from dtensor3d.checkpoint.hf import config_from_hf, hf_config

    v5 = transformers.LlamaConfig(**BASE, rope_parameters={**LLAMA3_ROPE, "rope_theta": 123456.0}).to_dict()
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4.update(rope_theta=123456.0, rope_scaling={**LLAMA3_ROPE, "type": "llama3"})
    del v4["rope_scaling"]["rope_type"]
    ours = config_from_hf(v5, "v5")
    assert ours == config_from_hf(v4, "v4")
    assert ours.rope_theta == 123456.0 and ours.rope_scaling == LLAMA3_ROPE
    assert hf_config(ours)["rope_parameters"] == {**LLAMA3_ROPE, "rope_theta": 123456.0}


def test_deepseek_v3_full_query_logits_equal_transformers(tmp_path):
    """DeepSeek-V3's other switches: one q_proj (q_lora_rank null), RoPE pairs not interleaved,
    attention biases (q_a/kv_a/o), the default RoPE; logits to 1e-5 relative (measured 0.0)."""
    extra = dict(**MLA, q_lora_rank=None, rope_interleave=False, attention_bias=True)
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**BASE, **extra})).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    assert any(n.endswith("kv_a_proj_with_mqa.bias") for n, _ in hf.named_parameters())
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert relative(load_model(tmp_path)(ids), hf(ids).logits) <= 1e-5


def test_qwen3_moe_switches_its_class_lacks_are_refused_on_export():
    """A Qwen3-MoE trained with aux-loss-free balancing holds a correction bias (and one with
    groups a group limit) that Qwen3MoeForCausalLM cannot: export-hf says so in one line;
    without them its config.json round-trips (num_experts, mlp_only_layers, norm_topk_prob)."""
    from dtensor3d.checkpoint.hf import config_from_hf, hf_config
    from dtensor3d.config.schema import ModelConfig
    from dtensor3d.errors import CheckpointError

    base = dict(family="qwen3_moe", num_local_experts=8, moe_intermediate_size=32, norm_topk_prob=False)
    cfg = ModelConfig(**base, mlp_only_layers=(1,), decoder_sparse_step=1)
    hf = hf_config(cfg)
    assert (hf["num_experts"], hf["mlp_only_layers"], hf["norm_topk_prob"]) == (8, [1], False)
    assert config_from_hf(hf, "config.json") == cfg
    from dtensor3d.checkpoint.hf_names import HFNames

    names = HFNames("qwen3_moe")  # the MoE block is `mlp` there (DeepSeek-V3's too), shared experts plural
    assert names.plain("model.layers.3.block_sparse_moe.gate.e_score_correction_bias") == (
        "model.layers.3.mlp.gate.e_score_correction_bias"
    )
    assert names.plain("model.layers.3.block_sparse_moe.shared_expert.up_proj.weight") == (
        "model.layers.3.mlp.shared_experts.up_proj.weight"
    )
    assert names.experts("model.layers.3.block_sparse_moe.experts.w2", 2) == [
        "model.layers.3.mlp.experts.0.down_proj.weight",
        "model.layers.3.mlp.experts.1.down_proj.weight",
    ]
    for extra, key in (({"router_bias_update_rate": 0.01}, "router_bias_update_rate"), ({"n_group": 2}, "n_group")):
        with pytest.raises(CheckpointError, match=f"model.{key}=.*Qwen3MoeForCausalLM has no such setting"):
            hf_config(ModelConfig(**base, **extra))


def test_gpt_oss_mxfp4_experts_read_as_transformers_dequantizes_them(tmp_path, monkeypatch, capsys):
    """The release's MXFP4 experts (gate_up_proj_blocks / _scales, down_proj_blocks / _scales, random
    here): our logits equal transformers' loading the same directory with Mxfp4Config(dequantize=True)
    (measured 8e-7 rel); without transformers' mxfp4 module, import-hf says what to do in one line."""
    from safetensors.torch import load_file, save_file

    config_cls, extra, _ = FAMILIES["gpt_oss"]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**BASE, **extra, "intermediate_size": 32})  # in widths: 32k
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(tmp_path)
    tensors, g = load_file(tmp_path / "model.safetensors"), torch.Generator().manual_seed(5)
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        e, d_in, d_out = tensors.pop(name).shape
        tensors[name + "_blocks"] = torch.randint(0, 256, (e, d_out, d_in // 32, 16), generator=g, dtype=torch.uint8)
        tensors[name + "_scales"] = torch.randint(120, 128, (e, d_out, d_in // 32), generator=g, dtype=torch.uint8)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((tmp_path / "config.json").read_text())
    keep = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    hf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": keep}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert relative(load_model(tmp_path)(ids), theirs(ids).logits) <= 1e-5
    monkeypatch.setitem(__import__("sys").modules, "transformers.integrations.mxfp4", None)  # not importable
    capsys.readouterr()  # transformers' progress bars
    assert main(["import-hf", str(tmp_path), str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "MXFP4" in err[0] and "pip install" in err[0], err
