"""The one ordered entry point from a recipe and a mesh to this rank's model part.

    step                 file                  why here in the order
    1 hooks              context.py, expert.py cp's token layout and ep's expert route are
                                               given to the model at construction (single-
                                               device code takes them as ModelHooks); so is
                                               recompute (none | full | selective)
    2 pipeline split     pipeline.py           later steps only touch this stage's modules
                                               (one module per stage; a rank may hold several)
      float8             float8.py             training.float8: torchao's Float8Linear for
                                               the block linears, before tp maps their styles
                                               (under cp: tensorwise casts over the cp group)
    3 tensor parallel    tensor.py             DTensor styles on whole (unsharded) weights
    4 context parallel   context.py            (step 1: it changes attention, not weights)
    5 expert parallel    expert.py             experts sharded over ep before FSDP sees them
    6 recompute          (models, step 1)      wraps whole layers; compile and FSDP wrap those
    7 compile            compile.py            one graph per block, with its DTensor layouts
                                               inside (and a selective checkpoint; a full one
                                               stays outside), FSDP's hooks outside
    8 fsdp               data.py               last: it shards whatever the others left;
                                               bf16 training gathers bf16 parameters here

Everything happens on the meta device; `train.setup` then materialises and initialises.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config.low_precision import float8_recipe
from ..models import build_on_meta, tie_weights
from ..models.layers import ModelHooks
from .compile import apply_compile, compile_backend
from .context import sequence_layout
from .data import apply_fsdp, fsdp_policy
from .expert import aux_loss_scale, expert_dispatch, shard_experts, token_share
from .float8 import apply_float8, scale_over_cp
from .pipeline import local_stages, merge_stages, split_stage
from .tensor import apply_tp, vocab_layout


def model_hooks(recipe, mesh, device: torch.device) -> ModelHooks:
    """What cp, ep, tp (the MoE token share) and recompute change inside the model (else single-device)."""
    p = recipe.parallelism
    return ModelHooks(
        sequence=sequence_layout(p, mesh, recipe.training.sequence_length, device),
        expert_dispatch=expert_dispatch(p, mesh),
        tokens=token_share(p, mesh),
        aux_loss_scale=aux_loss_scale(recipe),
        recompute=p.recompute,
        vocab_layout=vocab_layout,
    )


def parallelize_stage(recipe, mesh, stage: int, hooks: ModelHooks) -> nn.Module:
    """Global pipeline stage `stage` of the model (the whole model when pp == 1), on the meta
    device, with every parallelism applied in the order of the table above."""
    p = recipe.parallelism
    model = build_on_meta(recipe.model, hooks=hooks)
    split_stage(model, stage, p)
    apply_float8(model, recipe)  # training.float8: torchao's Float8Linear, before the tp styles see them
    scale_over_cp(model, recipe, mesh["cp"])  # cp > 1, tensorwise: casts scaled by the amax over cp
    if p.tp_enabled:
        # torchao's float8 tp styles cast before the module with the amax over tp only: not under cp
        styles = float8_recipe(recipe.training) if not p.cp_enabled else None
        apply_tp(model, mesh["tp"], p, compiled=recipe.training.compile, float8=styles)
        tie_weights(model)  # the vocab-parallel embedding and head share Shard(0) over tp
    if p.ep_enabled:
        shard_experts(model, mesh["ep"])
    if recipe.training.compile:
        apply_compile(model, compile_backend(mesh.device_type))
    if p.fsdp_enabled:
        apply_fsdp(model, mesh, p, fsdp_policy(mesh.device_type, recipe.training.dtype))
    return model


def parallelize_stages(recipe, mesh, coords: dict[str, int], device: torch.device):
    """(this rank's model, its pipeline stages as [(global stage index, module)]). With one
    stage per rank the model is that stage; with several (interleaved_1f1b, zbv, dualpipev)
    it is `merge_stages` over them: the same parameters under their global names."""
    hooks = model_hooks(recipe, mesh, device)
    parts = [(s, parallelize_stage(recipe, mesh, s, hooks)) for s in local_stages(coords["pp"], recipe.parallelism)]
    model = parts[0][1] if len(parts) == 1 else merge_stages([m for _, m in parts])
    return model, parts


def parallelize(recipe, mesh, coords: dict[str, int], device: torch.device) -> nn.Module:
    """This rank's part of the model, on the meta device, with every parallelism applied."""
    return parallelize_stages(recipe, mesh, coords, device)[0]
