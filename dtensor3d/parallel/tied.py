"""Tied embeddings across pipeline stages (Megatron-LM's embedding group), and the embedding
multi-token prediction shares (models/mtp.py: a pipeline's last stage holds the MTP modules,
which read the input embedding; its copy there, `model.mtp_embed_tokens`, is the tied head's
parameter where the model is tied, and is handled here exactly like the tied head's copy).

A tied model (`model.tie_word_embeddings`) uses one matrix as the embedding and as the head.
One process holds it once. Under pp the embedding lives on the first stage and the head on
the last, so each of those stages holds its own copy: both are initialised, saved (once) and
loaded under the embedding's name (models.stored_name), and after every backward their
gradients are summed (`sync_tied_grads`, before the grad norm and clipping):

- over the embedding group -- the two ranks of the first and the last pp stage with the same
  other coordinates (the pp group itself at pp 2) -- when they are different ranks;
- locally, with no communication, where one rank holds both stages (zbv and dualpipev fold
  the V back: rank 0 holds the first stage and the last, one module each).

Under those two schedules a tied model with MTP holds a third copy: the last stage's head
and MTP's embedding are two parameters there, not one, as torch's split backward
(stage_backward_weight) cannot take one parameter used at two sites of a stage (torch 2.13:
"Trying to backward through the graph a second time"; pytorch#180952 is that pattern's
double count, fixed before 2.13). All copies then take the same AdamW step
from the same values and stay bitwise equal. The global grad norm counts the matrix once:
each copy's share is weighted by 1/copies (`norm_share`). Under tp every copy is
vocab-parallel Shard(0), under FSDP each is dim-0 chunks of the same mesh, so the local
pieces of their gradients cover the same region.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..config.schema import V_SCHEDULES
from ..mesh import mesh_axis, rank_groups
from ..models import EMBEDDING, stored_name
from ..plan.schedule_model import stage_rank
from .shards import local

GROUP_DESC = "tied_embedding"  # parallel/comm.py counts this group's bytes under "pp"


@dataclass
class TiedGrads:
    """This rank's copies of the tied matrix (the embedding's, the head's or both) and the
    group to sum their gradient over (None: the other copy is on this rank, or none exists)."""

    params: list[nn.Parameter]
    group: dist.ProcessGroup | None


def split_apart(recipe) -> bool:
    """Whether the embedding matrix has two copies: a model split into pipeline stages whose
    last stage uses it too -- as the tied head, or as MTP's input embedding (models/mtp.py:
    `mtp_embed_tokens`, the tied head's parameter where both)."""
    m = recipe.model
    return bool(m.tie_word_embeddings or m.num_nextn_predict_layers) and recipe.parallelism.pp_enabled


def copies(recipe) -> int:
    """How many parameters hold the embedding matrix once it is split apart: the first
    stage's and the last stage's, plus under a V schedule the last stage's second one where a
    tied head and MTP both use it (their uses are one parameter elsewhere, but torch's split
    weight backward cannot take one parameter at two sites of a stage: models/llama.py's
    keep_only)."""
    m, p = recipe.model, recipe.parallelism
    return 3 if m.tie_word_embeddings and m.num_nextn_predict_layers and p.pp_engine in V_SCHEDULES else 2


def norm_share(recipe, cfg, name: str) -> float:
    """The weight of a parameter's squared gradient norm in the global norm beyond its
    replication: 1/copies for each copy of the embedding matrix split apart, 1 otherwise."""
    return 1 / copies(recipe) if split_apart(recipe) and stored_name(cfg, name) == EMBEDDING else 1.0


def embedding_group(recipe, mesh) -> dist.ProcessGroup | None:
    """This rank's embedding group (the pp ranks of the first and the last stage with its
    other coordinates); None where the two stages share a rank or nothing is tied. Every rank
    calls this in setup (creating the groups at pp > 2 is collective)."""
    p = recipe.parallelism
    if not split_apart(recipe):
        return None
    last = stage_rank(p, p.pp_stages - 1)
    if last == 0:
        return None  # a V schedule: rank 0 holds both stages
    if p.pp == 2:
        return mesh_axis(mesh, "pp").get_group()
    pairs = [[ranks[0], ranks[last]] for ranks in rank_groups(p.dims)["pp"]]
    mine, _ = dist.new_subgroups_by_enumeration(pairs, group_desc=GROUP_DESC)
    return mine


def tied_grads(recipe, model: nn.Module, mesh) -> TiedGrads | None:
    """What `sync_tied_grads` needs on this rank (None: no tied matrix split apart)."""
    if not split_apart(recipe):
        return None
    group = embedding_group(recipe, mesh)
    copies = [q for name, q in model.named_parameters() if stored_name(model.cfg, name) == EMBEDDING]
    return TiedGrads(copies, group)


@torch.no_grad()
def sync_tied_grads(tied: TiedGrads | None) -> None:
    """Step time, after backward: every copy's gradient becomes the sum of all copies'."""
    if tied is None or not tied.params:
        return
    grads = [local(q.grad) for q in tied.params if q.grad is not None]
    if not grads:
        return
    total = grads[0]
    for g in grads[1:]:
        total.add_(g)
    if tied.group is not None:
        dist.all_reduce(total, group=tied.group)
    for g in grads[1:]:
        g.copy_(total)
