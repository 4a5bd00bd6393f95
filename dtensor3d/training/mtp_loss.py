"""The multi-token prediction loss (model.num_nextn_predict_layers, models/mtp.py):

    loss = CE_main + (mtp_loss_weight / D) * sum_k CE_k

Each CE_k is a sum over the positions with a target k + 1 ahead inside the window (and, with
packed documents, inside the same document; a masked target counts nothing at any depth),
divided by the global batch's token count like the main loss, so the total is the same at any
mesh. `loss/main` and `loss/mtp_k` are logged beside `loss`; validation is the main loss alone
(the model computes MTP only in a grad-enabled training forward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..models.mtp import mtp_targets, mtp_token_ids
from ..parallel.shards import local


def wrap_loss_fn(main_fn, model_cfg, global_tokens: int, parts: list):
    """The training loss with MTP around `main_fn` (make_loss_fn's): logits [b, s, 1 + D, vocab]
    and targets [b, s, 1 + D] (expand_batch). Each call appends its detached [main, CE_1..CE_D]
    to `parts` (step_metrics). Plain [b, s, vocab] logits (validation) get the main loss."""
    depth, weight = model_cfg.num_nextn_predict_layers, model_cfg.mtp_loss_weight

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if logits.dim() == 3:
            return main_fn(logits, targets if targets.dim() == 2 else targets[..., 0])
        main = main_fn(logits[:, :, 0], targets[..., 0])
        ks = [
            F.cross_entropy(logits[:, :, k].flatten(0, 1).float(), targets[..., k].flatten(), reduction="sum")
            / global_tokens
            for k in range(1, depth + 1)
        ]
        parts.append(local(torch.stack([main, *ks]).detach()).float())
        return main + weight / depth * torch.stack(ks).sum()

    return loss_fn


def expand_batch(recipe, batch: tuple) -> tuple:
    """(inputs, targets [b, s, 1 + D], docs) from a batch of whole windows (models/mtp.py's
    mtp_targets; docs gains `mtp_ids`, the tokens k ahead: mtp_token_ids). Made before context
    parallelism's zigzag split (train.rank_batch), like the targets' own shift, so a chunk's
    last positions get the next chunk's tokens, wherever that chunk is; a pipeline hands
    mtp_ids to every stage with the documents' ids. A batch already expanded is returned as it is."""
    depth = recipe.model.num_nextn_predict_layers
    inputs, targets, *rest = batch
    if not depth or targets.dim() == 3:
        return batch
    docs = dict(rest[0]) if rest else {}
    targets = mtp_targets(targets, depth, docs.get("document_ids"))
    return inputs, targets, {**docs, "mtp_ids": mtp_token_ids(inputs, depth)}


def step_metrics(recipe, parts: list, reports: bool, loss_tokens: int | None, device) -> dict:
    """{"loss/main", "loss/mtp_k"} of the step: the microbatches' parts summed over the ranks
    that report the loss, renormalised like the loss where a loss mask leaves `loss_tokens`
    targets (train.renormalise). The step's rows are the last num_microbatches ones: a pipeline
    schedule also calls the loss in its shape inference (the first step, and again after a
    validation). Clears `parts`."""
    depth, t = recipe.model.num_nextn_predict_layers, recipe.training
    scale = 1.0 if loss_tokens is None else t.global_batch_size * t.sequence_length / max(loss_tokens, 1)
    parts[:] = parts[-recipe.num_microbatches :]
    total = torch.stack(parts).sum(0) if parts else torch.zeros(1 + depth, device=device)
    parts.clear()
    total = total.to(device) * float(reports)
    dist.all_reduce(total)
    values = (total * scale).tolist()
    return {"loss/main": values[0], **{f"loss/mtp_{k}": values[k] for k in range(1, depth + 1)}}
