"""The one ordered entry point from a recipe and a mesh to this rank's model part.

    step                 file                  why here in the order
    1 hooks              context.py, expert.py cp's token layout and ep's expert route are
                                               given to the model at construction (single-
                                               device code takes them as ModelHooks)
    2 pipeline split     pipeline.py           later steps only touch this stage's modules
    3 tensor parallel    tensor.py             DTensor styles on whole (unsharded) weights
    4 context parallel   context.py            (step 1: it changes attention, not weights)
    5 expert parallel    expert.py             experts sharded over ep before FSDP sees them
    6 recompute          (models, step 1)      wraps whole layers; FSDP then wraps those
    7 fsdp               data.py               last: it shards whatever the others left

Everything happens on the meta device; `train.setup` then materialises and initialises.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models import build_on_meta
from ..models.layers import ModelHooks
from .context import sequence_layout
from .data import apply_fsdp
from .expert import aux_loss_scale, expert_dispatch, shard_experts
from .pipeline import split_stage
from .tensor import apply_tp


def model_hooks(recipe, mesh, device: torch.device) -> ModelHooks:
    """What cp, ep and recompute change inside the model (single-device defaults otherwise)."""
    p = recipe.parallelism
    return ModelHooks(
        sequence=sequence_layout(p, mesh, recipe.training.sequence_length, device),
        expert_dispatch=expert_dispatch(p, mesh),
        aux_loss_scale=aux_loss_scale(recipe),
        recompute=p.recompute,
    )


def parallelize(recipe, mesh, coords: dict[str, int], device: torch.device) -> nn.Module:
    """This rank's part of the model, on the meta device, with every parallelism applied
    in the order of the table above."""
    p = recipe.parallelism
    model = build_on_meta(recipe.model, hooks=model_hooks(recipe, mesh, device))
    split_stage(model, coords["pp"], p)
    if p.tp_enabled:
        apply_tp(model, mesh["tp"], p)
    if p.ep_enabled:
        shard_experts(model, mesh["ep"])
    if p.fsdp_enabled:
        apply_fsdp(model, mesh, p)
    return model
