"""Pipeline parallelism: split the model into stages and drive them with PyTorch's schedules.

Build time: `local_stages` (which stages this rank holds), `split_stage` (one stage of the
meta model), `merge_stages` (a rank's stages seen as one model, for names) and
`build_schedule`. Step time: `schedule_step` runs every microbatch of the step through the
schedule.

The model is cut into pp x stages_per_rank stages. Stage i holds a contiguous run of decoder
blocks; the first stage also holds the embedding and the last the final norm, the head and
the loss. With one stage per rank (1f1b, afab) layers are balanced by count unless
`parallelism.pp_layers` lists them. Several stages per rank: interleaved_1f1b loops (rank r
holds stages r, r + pp, r + 2 pp, ...); zbv and dualpipev run a V (rank r holds stages r and
2 pp - 1 - r, so rank 0 holds the first and the last).

Each stage is its own module (PipelineStage and FSDP each take one root per stage); the
model a rank reports (`merge_stages`) shares their submodules, so parameter names stay
global (model.layers.<i>...) whatever the schedule, and a checkpoint moves between them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..config.schema import V_SCHEDULES, stage_layers  # torch-free (plan uses it); importable from here as before
from ..models import build_on_meta
from ..plan.schedule_model import rank_stages
from .shards import local

if TYPE_CHECKING:  # torch.distributed.pipelining is imported when a schedule is built: it
    # brings in torch._dynamo (~0.8 s per process), which a run without pp never needs
    from torch.distributed.pipelining.schedules import _Action


def forward_actions(order: dict[int, list[_Action | None]]) -> dict[int, list[_Action]]:
    """A compute-only pipeline order less its backward actions (overlapped F+B keeps its F):
    the forward-only order of an evaluation, in the training order's sequence."""
    from torch.distributed.pipelining.schedules import _ComputationType

    forward = _ComputationType.FORWARD
    out: dict[int, list[_Action]] = {}
    for rank, actions in order.items():
        out[rank] = []
        for a in actions:
            for sub in (a.sub_actions or (a,)) if a is not None else ():
                if sub.computation_type == forward:
                    out[rank].append(sub)
    return out


class ForwardOnlyEval:
    """For torch's multi-stage (runtime) schedules: `eval` runs only the forward actions.
    (torch 2.13's `eval` on them still executes the backward actions and fails.)"""

    def eval(self, *args, **kwargs):
        from torch.distributed.pipelining.schedules import _add_send_recv, _add_unshard_reshard

        train_order = self.pipeline_order_with_comms
        # torch's lowering (_prepare_schedule_with_comms) less its checks, which ask for backwards
        order = {rank: _add_unshard_reshard(actions) for rank, actions in forward_actions(self.pipeline_order).items()}
        self.pipeline_order_with_comms = _add_send_recv(
            order, stage_to_rank=lambda s: self.stage_index_to_group_rank[s], num_stages=self._num_stages
        )
        try:
            return super().eval(*args, **kwargs)
        finally:
            self.pipeline_order_with_comms = train_order


def schedule_class(pp_engine: str) -> type:
    """torch's schedule class for `parallelism.pp_engine` (the multi-stage ones with
    ForwardOnlyEval's `eval`)."""
    from torch.distributed import pipelining as pl

    single = {"1f1b": pl.Schedule1F1B, "afab": pl.ScheduleGPipe}
    if pp_engine in single:
        return single[pp_engine]
    multi = {
        "interleaved_1f1b": pl.ScheduleInterleaved1F1B,
        "zbv": pl.ScheduleZBVZeroBubble,
        "dualpipev": pl.ScheduleDualPipeV,
    }
    cls = multi[pp_engine]
    return type(cls.__name__, (ForwardOnlyEval, cls), {"__doc__": cls.__doc__})


def local_stages(pp_rank: int, parallelism) -> list[int]:
    """The global stage indices this pp rank holds, in the order its schedule lists them
    (schedule_model.rank_stages: the torch-free rule plan's estimate uses too)."""
    return rank_stages(parallelism, pp_rank)


def holds_first_stage(pp_rank: int, parallelism) -> bool:
    return 0 in local_stages(pp_rank, parallelism)


def holds_last_stage(pp_rank: int, parallelism) -> bool:
    """This rank computes the loss (the last stage: rank pp - 1, or rank 0 under a V schedule)."""
    return parallelism.pp_stages - 1 in local_stages(pp_rank, parallelism)


def split_stage(model: nn.Module, stage: int, parallelism) -> nn.Module:
    """Reduce a whole (meta-device) model to global pipeline stage `stage`, in place."""
    p = parallelism
    if not p.pp_enabled:
        return model
    pp_layers = p.pp_layers if p.stages_per_rank == 1 else None
    layers = stage_layers(model.cfg.num_hidden_layers, p.pp_stages, pp_layers)[stage]
    last, split_backward = stage == p.pp_stages - 1, p.pp_engine in V_SCHEDULES
    return model.keep_only(layers, first=stage == 0, last=last, split_backward=split_backward)


def merge_stages(parts: list[nn.Module]) -> nn.Module:
    """One model over a rank's stage modules, sharing their submodules (no copies): its
    named_parameters are the stages' under their global names, in layer order."""
    merged = build_on_meta(parts[0].cfg)
    layers = {i: block for part in parts for i, block in part.model.layers.items()}
    merged.model.layers = nn.ModuleDict({i: layers[i] for i in sorted(layers, key=int)})
    merged.model.embed_tokens = next((q.model.embed_tokens for q in parts if q.model.embed_tokens is not None), None)
    merged.model.norm = next((q.model.norm for q in parts if q.model.norm is not None), None)
    merged.lm_head = next((q.lm_head for q in parts if q.lm_head is not None), None)
    for name in ("mtp", "mtp_embed_tokens"):  # the last stage's MTP modules and embedding copy (models/mtp.py)
        held = [getattr(q.model, name) for q in parts if getattr(q.model, name) is not None]
        setattr(merged.model, name, held[0] if held else None)
    # whether MTP's copy is the tied head's parameter (models/llama.py keep_only): the merged
    # model ties its head the way the stage that holds both did
    merged.model.mtp_shares_head = any(getattr(q.model, "mtp_shares_head", False) for q in parts)
    return merged


def build_schedule(
    parts: list[tuple[int, nn.Module]], mesh, device: torch.device, parallelism, n_microbatches: int, loss_fn
):
    """PipelineStages for this rank's (stage index, module) parts and the schedule named by
    `pp_engine` (the multi-stage schedules take a list of stages); None without pp.

    Gradients are not rescaled by the microbatch count: `loss_fn` already divides by the
    token count of the whole global batch."""
    if not parallelism.pp_enabled:
        return None
    from torch.distributed.pipelining import PipelineStage

    group, total = mesh["pp"].get_group(), parallelism.pp_stages
    stages = [PipelineStage(module, index, total, device, group=group) for index, module in parts]
    schedule_cls = schedule_class(parallelism.pp_engine)
    first = stages if parallelism.stages_per_rank > 1 else stages[0]
    return schedule_cls(first, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


def schedule_step(
    schedule,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    stage: int,
    parallelism,
    forward_only: bool = False,
    docs: dict | None = None,
) -> torch.Tensor:
    """Step time: run the step's microbatches through the schedule (inputs enter on the rank
    holding the first stage, targets and the loss live on the one holding the last); return
    the sum of this rank's microbatch losses (zero where it holds no last stage). `stage` is
    this rank's pp coordinate; `forward_only`: the schedule's eval (validation, no backward).
    `docs`: the packed documents' position_ids and document_ids, given to every stage as
    keyword arguments (the schedule splits them into the same microbatches as the inputs)."""
    first, last = holds_first_stage(stage, parallelism), holds_last_stage(stage, parallelism)
    losses: list[torch.Tensor] = []
    args = (inputs,) if first else ()
    run = schedule.eval if forward_only else schedule.step
    run(*args, target=targets if last else None, losses=losses if last else None, **(docs or {}))
    total = torch.zeros((), device=inputs.device)
    for loss in losses:
        total += local(loss.detach()).float()
    return total
