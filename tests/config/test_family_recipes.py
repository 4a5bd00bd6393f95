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
    if recipe.parallelism.tp == 1 and recipe.parallelism.pp == 1:  # FSDP splits the whole model over dp
        assert stages[0]["params"] * recipe.parallelism.dp == RECIPES[name]
