"""The family planning recipes: the recipe checks and `plan` accept each (in-process), and the
parameter count is the published one (the Hugging Face checkpoint's tensor total)."""

from __future__ import annotations

import json
import math

import pytest

from dtensor3d.__main__ import main
from dtensor3d.config.checks import validate
from dtensor3d.config.load import load_recipe
from dtensor3d.plan.shapes import param_shapes

# recipe -> parameters of the released checkpoint (tied embeddings counted once)
RECIPES = {
    "llama3_1_8b_plan": 8_030_261_248,
    "llama3_1_70b_plan": 70_553_706_496,
    "qwen3_0_6b_plan": 596_049_920,
    "qwen3_8b_plan": 8_190_735_360,
    # from its config.json: 48 x (attention 18,878,720 + router 262,144 + 128 experts 603,979,776)
    # + embedding and head 622,329,856 + final norm 2,048 (the model card's 30.5B)
    "qwen3_30b_a3b_plan": 30_532_122_624,
    "smollm2_135m_plan": 134_515_008,
    "smollm2_1_7b_plan": 1_711_376_384,
    # DeepSeek-V3 with its multi-token prediction module: the paper's 671B (671,026,419,200, the
    # main model as transformers loads it) + the MTP layer's own 11,610,068,224 (one MoE layer,
    # eh_proj, its norms); the Hugging Face checkpoint's 684.5B (README_WEIGHTS.md: 685B = 671B +
    # 14B) also holds that layer's copies of the embedding and head (test_deepseek_v3_total_...).
    "deepseek_v3_671b_plan": 682_636_487_424,
    # 36 x (attention 10,489,856 + MLP 67,633,152 + norms 4,096) + tied embedding 262,668,288 + final
    # norm 2,048: the model card's 3.08B
    "smollm3_3b_plan": 3_075_098_624,
    # 32 x (attention 67,108,864 + whole-projection q/k norms 8,192 + MLP 135,266,304 + post norms
    # 8,192) + embedding and head 822,083,584 + final norm 4,096: the model card's 7.30B
    "olmo2_7b_plan": 7_298_617_344,
    # 26 x (attention 2,949,632 with its per-head q/k norms + GeGLU 23,887,872 + four norms 4,608) + tied
    # embedding 301,989,888 + final norm 1,152: google/gemma-3-1b-pt's 999,885,952
    "gemma3_1b_plan": 999_885_952,
    # 32 x (attention 37,748,736 + MLP 75,497,472 + norms 6,144) + embedding and head 197,001,216 +
    # final norm 3,072: the model card's 3.8B
    "phi3_mini_plan": 3_821_079_552,
    # 24 x (attention 26,550,144 with its biases and 64 sinks + router 92,192 + 32 experts with biases
    # 796,538,880 + norms 5,760) + embedding and head 1,158,266,880 + final norm 2,880: the model card's
    # 20.9B (a meta-device GptOssForCausalLM at the release's config counts the same)
    "gpt_oss_20b_plan": 20_914_757_184,
    # 36 x (attention 26,550,144 + router 368,768 + 128 experts 3,186,155,520 + norms 5,760) + embedding
    # and head 1,158,266,880 + final norm 2,880: the model card's 116.8B
    "gpt_oss_120b_plan": 116_829_156_672,
    # Each total below also equals a meta-device transformers model at the released config
    # (AutoModelForCausalLM.from_config, parameters counted once), measured for issue 38.
    # 34 x (attention 15,729,152 + GeGLU 78,643,200 + four norms 10,240) + tied embedding (the
    # multimodal vocabulary, 262,208) 671,252,480 + final norm 2,560: google/gemma-3-4b-pt's language model
    "gemma3_4b_plan": 3_880_263_168,
    # 62 x (attention 66,060,544 + GeGLU 346,816,512 + four norms 21,504) + tied embedding
    # 1,409,630,208 + final norm 5,376: google/gemma-3-27b-pt's language model
    "gemma3_27b_plan": 27_009_346_304,
    # OLMo 2 7B's layers (32 x 202,391,552) + embedding and head of the 100,278-token vocabulary
    # 821,477,376 + final norm 4,096: allenai/Olmo-3-1025-7B
    "olmo3_7b_plan": 7_298_011_136,
    # 46 layers (attention 109,066,240 each; layer 0 dense, 45 x 128 routed + 1 shared expert 1,408
    # wide, router and its correction bias) + embedding and head 1,241,513,984: 106.85B, of which
    # 12.18B (embedding and head aside) run per token -- the card's 106B / 12B. transformers counts
    # the 45 correction biases (5,760) as buffers: 106,852,245,504 parameters there.
    "glm4_5_air_plan": 106_852_251_264,
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_family_recipe_plans(name, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = f"recipes/{name}.yaml"
    cfg = load_recipe(path).model
    assert sum(math.prod(s) for s in param_shapes(cfg).values()) == RECIPES[name]
    validate(load_recipe(path), world_size=load_recipe(path).parallelism.world_size)  # `validate` wants the GPU
    assert main(["plan", path, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    recipe = load_recipe(path)
    assert out["world_size"] == recipe.parallelism.world_size
    stages = out["estimate"]["stages"]
    if recipe.parallelism.tp == 1 and recipe.parallelism.pp == 1:  # FSDP splits the whole model over ep x dp
        assert stages[0]["params"] * recipe.parallelism.dp * recipe.parallelism.ep == RECIPES[name]


def test_deepseek_v3_total_is_the_released_checkpoints():
    """The 671B recipe's model plus the MTP layer's embedding and head copies the checkpoint
    stores (shapes.mtp_copies) is the released 684,489,845,504 = 671,026,419,200 + 13,463,426,304
    (DeepSeek-V3's README_WEIGHTS.md: 685B, 14B of them the MTP module)."""
    from dtensor3d.plan.shapes import mtp_copies

    cfg = load_recipe("recipes/deepseek_v3_671b_plan.yaml").model
    assert cfg.num_nextn_predict_layers == 1
    total = sum(math.prod(s) for s in param_shapes(cfg).values())
    assert total + mtp_copies(cfg) == 671_026_419_200 + 13_463_426_304
