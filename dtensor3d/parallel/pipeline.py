"""Pipeline parallelism: split the model into stages and drive them with PyTorch's schedules.

Build time: `split_stage` (this rank's stage of the meta model) and `build_schedule`.
Step time: `schedule_step` runs every microbatch of the step through the schedule.

Stage i holds a contiguous run of decoder blocks; the first stage also holds the embedding
and the last the final norm, the head and the loss. Layers are balanced by count unless
`parallelism.pp_layers` lists them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from ..recipe import stage_layers  # torch-free (plan uses it); importable from here as before
from .shards import local

SCHEDULES = {"1f1b": Schedule1F1B, "afab": ScheduleGPipe}


def split_stage(model: nn.Module, stage: int, parallelism) -> nn.Module:
    """Reduce a whole (meta-device) model to pipeline stage `stage`, in place."""
    if not parallelism.pp_enabled:
        return model
    layers = stage_layers(model.cfg.num_hidden_layers, parallelism.pp, parallelism.pp_layers)[stage]
    return model.keep_only(layers, first=stage == 0, last=stage == parallelism.pp - 1)


def build_schedule(
    stage_module: nn.Module, stage: int, pp_mesh, device: torch.device, parallelism, n_microbatches: int, loss_fn
):
    """A PipelineStage for this rank and the schedule named by `pp_engine`.

    Gradients are not rescaled by the microbatch count: `loss_fn` already divides by the
    token count of the whole global batch."""
    pipeline_stage = PipelineStage(stage_module, stage, parallelism.pp, device, group=pp_mesh.get_group())
    schedule_cls = SCHEDULES[parallelism.pp_engine]
    return schedule_cls(pipeline_stage, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


def schedule_step(schedule, inputs: torch.Tensor, targets: torch.Tensor, stage: int, parallelism) -> torch.Tensor:
    """Step time: run the step's microbatches through the schedule (inputs enter on the first
    stage, targets and the loss live on the last); return the sum of this rank's microbatch
    losses (zero off the last stage)."""
    first, last = stage == 0, stage == parallelism.pp - 1
    losses: list[torch.Tensor] = []
    args = (inputs,) if first else ()
    schedule.step(*args, target=targets if last else None, losses=losses if last else None)
    total = torch.zeros((), device=inputs.device)
    for loss in losses:
        total += local(loss.detach()).float()
    return total
