"""Validation loss: the mean token loss over a fixed set of validation windows, forward
only (no gradients, no optimizer state touched), under every mesh.

Evaluation batch b holds validation samples [b * global_batch_size, (b + 1) *
global_batch_size), split over the ranks exactly as a training batch is, so the set and
the number are the same at every mesh. Each batch's loss is normalised like a training
loss (by the tokens of the global batch); their mean over `eval_batches` is the mean token
loss. With a loss mask (--chat data) the masked targets add nothing and their sum is
divided by the count of counted targets over all `eval_batches` batches instead.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..parallel import context, data, pipeline, tensor
from ..parallel.shards import local
from . import balance


def eval_due(recipe, step: int) -> bool:
    """training.eval_every's steps; never with data.validation null (none) on prepared data."""
    every, d = recipe.training.eval_every, recipe.data
    if d.kind == "tokens" and d.validation is None:  # no validation (a warning at load: config/data_sources.py)
        return False
    return every > 0 and (step % every == 0 or step == recipe.training.steps)


def _forward_only(state, inputs: torch.Tensor, targets: torch.Tensor, docs: dict | None = None) -> torch.Tensor:
    """Sum of this rank's microbatch losses of one batch (zero where it computes none);
    `docs`: its packed documents (data.document_masking), as in training."""
    p, mbs, docs = state.recipe.parallelism, state.recipe.training.micro_batch_size, docs or {}
    if state.schedule is not None:
        stage = state.coords["pp"]
        return pipeline.schedule_step(state.schedule, inputs, targets, stage, p, forward_only=True, docs=docs)
    total = torch.zeros((), device=state.device)
    for m in range(inputs.shape[0] // mbs):
        rows = slice(m * mbs, (m + 1) * mbs)
        total += local(state.loss_fn(state.model(inputs[rows], **data.rows_of(docs, rows)), targets[rows])).float()
    return total


def validation_loss(state, source, compute_context) -> dict:
    """{"val_loss", "val_ppl"} over recipe.training.eval_batches batches of `source`
    (sample(i) -> a validation window). Every rank calls this; all get the same numbers."""
    recipe, p = state.recipe, state.recipe.parallelism
    total = torch.zeros((), device=state.device)
    with torch.no_grad(), tensor.loss_context(p), compute_context:
        for b in range(recipe.training.eval_batches):
            batch = data.rank_samples(recipe, state.coords, source, b)
            total += _forward_only(state, *data.batch_to(context.shard_batch(batch, p, state.coords), state.device))
    reports = state.is_last_stage and state.coords["tp"] == 0
    total = total * reports
    dist.all_reduce(total)
    balance.step_stats(state.model, recipe, state.coords, state.device)  # drop the routing records of eval
    loss = total.item() / recipe.training.eval_batches
    if getattr(source, "masked", False):  # the batch losses' sum over the counted targets of all batches
        t = recipe.training
        loss = (
            total.item()
            * t.global_batch_size
            * t.sequence_length
            / max(data.loss_tokens(recipe, source, 0, t.eval_batches), 1)
        )
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}
