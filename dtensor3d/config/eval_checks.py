"""Door checks of downstream evaluation in the loop (the `eval` section) and of W&B
(logging.wandb): each one RecipeError line naming the key, the value and what is valid.
Pure: the file system and importlib only (the task names are checked against lm-eval's
index by harness.door, which needs the package)."""

from __future__ import annotations

import importlib.util
import os

from ..errors import RecipeError

WANDB_KEYS = ("project", "entity", "name", "mode", "tags")
WANDB_MODES = ("online", "offline")


def installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def validate_eval(recipe) -> None:
    """eval.every without tasks (and tasks without every), a limit <= 0, a missing
    include_path, lm-eval not installed, data without a tokenizer (every mesh runs it)."""
    e = recipe.eval
    if e.every < 0:
        raise RecipeError(f"eval.every={e.every} must be >= 0 (0: never)")
    if e.every and not e.tasks:
        raise RecipeError(f"eval.every={e.every} needs eval.tasks (lm-eval task names, e.g. [hellaswag]); none given")
    if e.tasks and not e.every:
        raise RecipeError(f"eval.tasks={list(e.tasks)} needs eval.every > 0 (steps between evaluations); got 0")
    if not e.tasks:
        return
    if e.limit is not None and e.limit <= 0:
        raise RecipeError(f"eval.limit={e.limit} must be > 0 (documents per task; a fraction if < 1) or null")
    if e.num_fewshot is not None and e.num_fewshot < 0:
        raise RecipeError(f"eval.num_fewshot={e.num_fewshot} must be >= 0 or null (the task's)")
    if e.include_path and not os.path.isdir(e.include_path):
        raise RecipeError(f"eval.include_path={e.include_path!r}: no such directory; give a folder of task YAML files")
    if not installed("lm_eval"):
        raise RecipeError(
            f"eval.tasks={list(e.tasks)} needs lm-evaluation-harness; pip install 'dtensor3d[eval]' "
            "or remove eval.tasks"
        )
    if recipe.data.kind != "tokens":
        raise RecipeError(
            f"eval.tasks={list(e.tasks)} needs the data's tokenizer: data.kind=tokens with a prepared directory "
            f"(prepare-data writes tokenizer.json); got data.kind={recipe.data.kind}"
        )


def validate_wandb(recipe) -> None:
    """logging.wandb: known keys, a valid mode, and the package installed."""
    w = recipe.logging.wandb
    if w is None:
        return
    unknown = sorted(set(w) - set(WANDB_KEYS))
    if unknown:
        raise RecipeError(f"logging.wandb.{unknown[0]}: unknown key; valid: {', '.join(WANDB_KEYS)}")
    mode = w.get("mode", "online")
    if mode not in WANDB_MODES:
        raise RecipeError(f"logging.wandb.mode={mode!r} is not a valid choice; valid: {', '.join(WANDB_MODES)}")
    tags = w.get("tags")
    if tags is not None and (not isinstance(tags, list) or not all(isinstance(t, str) for t in tags)):
        raise RecipeError(f"logging.wandb.tags={tags!r} must be a list of strings")
    if not installed("wandb"):
        raise RecipeError(
            "logging.wandb is set but wandb is not installed; pip install 'dtensor3d[wandb]' or set logging.wandb: null"
        )
