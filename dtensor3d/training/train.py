"""Training: setup (a recipe becomes an explicit TrainState), the step
(`train_step(state, batch) -> metrics`) and the loop.

Setup order (../docs/architecture.md): process group -> mesh -> parallelize (on meta:
pipeline split, tp, cp, ep, recompute, fsdp; parallel/parallelize.py) -> materialise +
topology-independent init -> optimizer -> pipeline schedule -> resume or Hugging Face init.
What each parallel dimension does at step time lives in its own file under parallel/.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .. import checkpoint
from ..config.data_sources import unique_sources
from ..config.lr import lr_at
from ..config.schema import Recipe
from ..datasets.sources import epoch_note, make_source
from ..errors import UserError, is_rank0
from ..mesh import build_mesh, init_distributed, mesh_coords, set_timeout
from ..models import materialize
from ..parallel import context, data, expert, float8, pipeline, tensor, tied
from ..parallel.compile import compile_seconds
from ..parallel.parallelize import parallelize_stages
from ..parallel.shards import init_weights, local, write_layout
from . import balance, faults, hooks, mtp_loss, skip, zloss
from .metrics import straggle
from .optim import build_optimizer, clip_, grad_sq_partial, replication
from .reshard_auto import decide_reshard

if TYPE_CHECKING:  # imported only when pp > 1 builds a schedule (parallel/pipeline.py)
    from torch.distributed.pipelining.schedules import _PipelineSchedule

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class TrainState:
    """Everything a step reads or changes, explicit."""

    recipe: Recipe
    mesh: DeviceMesh
    device: torch.device
    coords: dict[str, int]  # this rank's coordinate on each mesh axis
    model: nn.Module  # this rank's model part (the whole model when pp == 1)
    optimizer: torch.optim.Optimizer
    schedule: _PipelineSchedule | None  # the pipeline schedule when pp > 1
    loss_fn: LossFn
    params: list[nn.Parameter]  # the trainable parameters, in a fixed order
    norm_weights: list[float]  # 1 / replication of each parameter, for the global grad norm
    tied_copies: tied.TiedGrads | None = None  # a tied embedding split over pipeline stages (parallel/tied.py)
    step: int = 0
    compile_reported: bool = False  # training.compile: the compile time was printed (after the first step)
    loss_rows: list[torch.Tensor] | None = None  # a data mixture: each row's [loss sum, tokens] (make_loss_fn)
    source_names: tuple[str, ...] = ()  # a data mixture: its sources, as batches index them
    load_streaks: dict[int, int] = field(default_factory=dict)  # MoE layer -> steps over the load warning
    mtp_parts: list = field(default_factory=list)  # MTP: the step's [main, CE_1..CE_D] rows (training/mtp_loss.py)
    z_parts: list = field(default_factory=list)  # training.z_loss: each microbatch's z-loss (training/zloss.py)
    spikes: skip.SpikeWindow | None = None  # training.skip_spikes: the applied steps' window (training/skip.py)
    held_steps: int = 0  # steps skipped with the lr schedule held: the schedule reads step - held_steps
    wandb_id: str | None = None  # logging.wandb: the W&B run's id (rank 0), kept in the checkpoint

    @property
    def is_last_stage(self) -> bool:
        """This rank holds the last pipeline stage (the loss): rank pp - 1, or 0 under a V schedule."""
        return pipeline.holds_last_stage(self.coords["pp"], self.recipe.parallelism)


def resolve_device(choice: str) -> str:
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def make_loss_fn(global_tokens: int, rows: list[torch.Tensor] | None = None) -> LossFn:
    """Sum of token losses / tokens in the whole global batch: the same number at any mesh,
    and gradients that only need summing across ranks and microbatches. A target a loss mask
    excludes is data.IGNORE, cross_entropy's default ignore_index: it adds nothing (the step
    then renormalises by the count of the others, `renormalise`). With `rows` (a data
    mixture), each call also appends its rows' [loss sum, counted targets], detached: the
    per-source losses are read from them (per_source_sums), off the backpropagated loss."""

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if rows is None:
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), reduction="sum") / global_tokens
        per_token = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), reduction="none")
        counted = (targets != data.IGNORE).float()  # a masked target counts nothing
        rows.append(torch.stack([local(per_token.detach()).view_as(counted).sum(1), counted.sum(1)], 1))
        return per_token.sum() / global_tokens

    return loss_fn


def setup(recipe: Recipe) -> TrainState:
    device = init_distributed(resolve_device(recipe.training.device), recipe.training.timeout_s)
    recipe = decide_reshard(recipe, device)  # fsdp_reshard_after_forward auto: this device's memory decides
    torch.manual_seed(recipe.training.seed)
    mesh = build_mesh(recipe.parallelism, device.type)
    set_timeout(recipe.training.timeout_s)  # the mesh's groups too, for the rest of setup
    coords = mesh_coords(mesh)
    model, parts = parallelize_stages(recipe, mesh, coords, device)  # parts: this rank's pipeline stages
    model = materialize(model, device)
    init_weights(model, recipe.training.seed)
    t, p = recipe.training, recipe.parallelism
    loss_rows = [] if recipe.data.sources is not None or recipe.data.stages is not None else None
    loss_fn = make_loss_fn(t.global_batch_size * t.sequence_length, loss_rows)
    z_parts: list = []  # training.z_loss: each microbatch's z-loss, taken off the logged loss (training/zloss.py)
    if t.z_loss > 0:
        loss_fn = zloss.with_z_loss(loss_fn, t.z_loss, t.global_batch_size * t.sequence_length, data.IGNORE, z_parts)
    mtp_parts: list = []  # model.num_nextn_predict_layers: each microbatch's [main, CE_1..CE_D] (training/mtp_loss.py)
    if recipe.model.num_nextn_predict_layers:
        loss_fn = mtp_loss.wrap_loss_fn(loss_fn, recipe.model, t.global_batch_size * t.sequence_length, mtp_parts)
    schedule = pipeline.build_schedule(parts, mesh, device, p, recipe.num_microbatches, loss_fn)
    optimizer = build_optimizer([model], recipe.optimizer)
    named = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
    params = [q for _, q in named]
    share = [tied.norm_share(recipe, model.cfg, n) / replication(q, dist.get_world_size(), p.pp) for n, q in named]
    state = TrainState(recipe, mesh, device, coords, model, optimizer, schedule, loss_fn, params, share)
    state.tied_copies = tied.tied_grads(recipe, model, mesh)
    state.mtp_parts, state.z_parts, state.spikes = mtp_parts, z_parts, skip.spike_window(recipe.training)
    if loss_rows is not None:  # the mixture's sources, in make_source's order (Mixture.names)
        state.loss_rows, state.source_names = loss_rows, tuple(s.name for _, s in unique_sources(recipe.data))
    checkpoint.load_at_start(state)  # resume (model, optimizer, step, RNG) or Hugging Face init
    if recipe.training.float8 is not None and is_rank0():  # which linears run in float8 (this stage's, rank 0)
        print(float8.describe(float8.converted(model), recipe), flush=True)
    return state


def compute_dtype_context(state: TrainState):
    """training.dtype bfloat16 computes in bf16 over fp32 master weights: where FSDP is used
    its MixedPrecisionPolicy gathers bf16 parameters (parallel/data.py's fsdp_policy) and
    reduces gradients in fp32, so no autocast; elsewhere bf16 autocast."""
    t = state.recipe.training
    if t.dtype == "bfloat16" and not state.recipe.parallelism.fsdp_enabled:
        return torch.autocast(state.device.type, dtype=torch.bfloat16)
    return torch.autocast(state.device.type, enabled=False)


def forward_backward(
    state: TrainState, inputs: torch.Tensor, targets: torch.Tensor, docs: dict | None = None
) -> torch.Tensor:
    """Run every microbatch of this rank's local batch; return the sum of its losses (zero
    where this rank computes none). `docs`: the packed documents' position_ids and
    document_ids (data.document_masking), the model's keyword arguments, split like the
    inputs. With training.compile, rank 0 prints the compile time once, after the first step
    (torch compiles each block in its first forward and backward)."""
    total = _microbatches(state, inputs, targets, docs or {})
    if state.recipe.training.compile and not state.compile_reported:
        state.compile_reported = True
        if is_rank0():
            n = len(state.model.model.layers)
            print(f"compile: {compile_seconds():.1f} s compiling {n} decoder blocks on rank 0", flush=True)
    return total


def _microbatches(state: TrainState, inputs: torch.Tensor, targets: torch.Tensor, docs: dict) -> torch.Tensor:
    p, mbs = state.recipe.parallelism, state.recipe.training.micro_batch_size
    with tensor.loss_context(p), compute_dtype_context(state):
        if state.schedule is not None:
            return pipeline.schedule_step(state.schedule, inputs, targets, state.coords["pp"], p, docs=docs)
        total = torch.zeros((), device=state.device)
        n_micro = inputs.shape[0] // mbs
        for m in range(n_micro):
            rows = slice(m * mbs, (m + 1) * mbs)
            data.gradient_sync(state.model, p, last_microbatch=m == n_micro - 1)
            loss = state.loss_fn(state.model(inputs[rows], **data.rows_of(docs, rows)), targets[rows])
            loss.backward()
            total += local(loss.detach()).float()
    return total


def train_step(
    state: TrainState, batch: tuple, loss_tokens: int | None = None, sources: torch.Tensor | None = None
) -> dict:
    """One optimizer step over one global batch; returns loss, grad_norm and lr (and the MoE
    statistics for a model with experts). `loss_tokens`: the global count of the targets that
    count, where a loss mask excludes some (data.loss_tokens; None: every target counts).
    `sources`: a data mixture's source index of each of this rank's rows (data.rank_sources),
    for `loss/<name>` and `tokens/<name>` of each source in the step."""
    recipe = state.recipe
    state.optimizer.zero_grad(set_to_none=True)
    if state.loss_rows is not None:
        state.loss_rows.clear()  # validation's rows too, since the last step
    loss_sum, z_sum = _losses(state, batch, loss_tokens)
    tensor.match_grad_placements(state.params)
    data.sync_replicated_grads(state.model, state.params, state.mesh, recipe.parallelism)
    tied.sync_tied_grads(state.tied_copies)  # a tied embedding's copies on the first and last stage
    expert.sum_tp_grads(state.model, recipe.parallelism, state.mesh)
    # One world all-reduce carries the loss (from the last stage's tp-rank-0 ranks), the
    # squared grad norm (each copy weighted by 1 / its replication) and the MoE statistics.
    reports_loss = state.is_last_stage and state.coords["tp"] == 0
    grad_sq = grad_sq_partial(state.params, state.norm_weights).to(state.device)
    moe = balance.step_stats(state.model, recipe, state.coords, state.device)
    per_source = per_source_sums(state, sources) * reports_loss
    stats = torch.cat([torch.stack([loss_sum * reports_loss, grad_sq]), moe, per_source.flatten(), z_sum.view(1)])
    dist.all_reduce(stats)
    loss, grad_norm = stats[0].item(), math.sqrt(stats[1].item())
    lr = lr_at(state.step - state.held_steps, recipe.optimizer, recipe.training.steps)
    # A NaN/inf loss or norm is the same on every rank (all-reduced): all skip the update.
    bad = faults.nonfinite(state.model, state.coords["pp"], loss, grad_norm)
    reason = skip.reason_to_skip(state, loss_tokens, loss, grad_norm)  # the same on every rank (training/skip.py)
    if bad is None and reason is None:
        clip_(state.params, grad_norm, recipe.optimizer.clip_grad)
        for group in state.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)  # Muon's group: muon_lr / lr (training/muon.py)
        state.optimizer.step()
        float8.precompute_scales(state.model, recipe)  # FSDP's float8 all-gather: next step's scales, one all-reduce
        balance.update_router_bias(state.model, recipe, stats[2 : 2 + len(moe)])
        skip.applied(state, loss, grad_norm)  # training.skip_spikes: the window of applied steps
    state.held_steps += reason in skip.HOLD_SCHEDULE
    state.step += 1
    metrics = {"step": state.step, "loss": loss, "grad_norm": grad_norm, "lr": lr}
    if bad is not None:
        metrics["nonfinite"] = bad  # the loop stops or counts it (faults.SkipCount)
    if reason is not None:
        skip.mark(metrics, reason)
    if recipe.model.num_local_experts:
        _moe_metrics(state, metrics, stats[2 : 2 + len(moe)])
    metrics.update(source_metrics(stats[2 + len(moe) : -1].view(-1, 2), state.source_names))
    _loss_parts(state, metrics, stats[-1].item(), reports_loss, loss_tokens)
    return metrics


def _losses(state: TrainState, batch: tuple, loss_tokens: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward over this rank's microbatches: (its loss sum, the cross-entropy
    alone, and its z-loss sum: training/zloss.py), renormalised for a loss mask (renormalise)."""
    recipe = state.recipe
    total = forward_backward(state, *mtp_loss.expand_batch(recipe, batch))
    z_sum = zloss.take(state.z_parts, recipe.num_microbatches, state.device) * loss_scale(recipe, loss_tokens)
    z_sum = z_sum * (state.is_last_stage and state.coords["tp"] == 0)  # counted once, like the loss
    return renormalise(state, total, loss_tokens) - z_sum, z_sum


def _loss_parts(state: TrainState, metrics: dict, z_loss: float, reports_loss: bool, loss_tokens) -> None:
    """`z_loss` (training.z_loss) and MTP's `loss/main`, `loss/mtp_k` beside `loss`: each the
    cross-entropy alone (the z-loss apart)."""
    recipe = state.recipe
    if recipe.training.z_loss > 0:
        metrics["z_loss"] = z_loss
    if recipe.model.num_nextn_predict_layers:
        metrics.update(mtp_loss.step_metrics(recipe, state.mtp_parts, reports_loss, loss_tokens, state.device))
        metrics["loss/main"] -= metrics.get("z_loss", 0.0)  # the main logits' z-loss, as `loss`


def _moe_metrics(state: TrainState, metrics: dict, stats: torch.Tensor) -> None:
    """The step's expert-load metrics (training/balance.py), the bias range when balancing,
    and rank 0's one-line warning when a layer's load stays unbalanced."""
    recipe = state.recipe
    metrics.update(balance.stats_metrics(stats, recipe))
    if recipe.model.router_bias_update_rate > 0:
        metrics["router_bias_range"] = balance.bias_ranges(state.model, recipe, state.device)
    line = balance.load_warning(state.load_streaks, metrics["expert_load_by_layer"], recipe)
    if line and is_rank0():
        print(line, flush=True)


def per_source_sums(state: TrainState, sources: torch.Tensor | None) -> torch.Tensor:
    """[n_sources, 2]: this rank's loss sum and token count of each source's rows: the last
    len(sources) rows the loss recorded, in the order its microbatches computed them (every
    pipeline schedule computes a stage's microbatch losses in microbatch order, after the
    loss call of its first step's shape inference). Empty without a mixture; zeros where
    this rank computes no loss."""
    if sources is None:
        return torch.zeros(0, 2, device=state.device)
    sums = torch.zeros(len(state.source_names), 2, device=state.device)
    if state.loss_rows:
        sums.index_add_(0, sources.to(state.device), torch.cat(state.loss_rows)[-len(sources) :].float())
    return sums


def source_metrics(sums: torch.Tensor, names) -> dict:
    """`loss/<name>` (token-weighted over the global batch) and `tokens/<name>` of each source
    that has tokens in the step."""
    out = {}
    for name, (loss, tokens) in zip(names, sums.tolist()):
        if tokens > 0:
            out[f"loss/{name}"], out[f"tokens/{name}"] = loss / tokens, int(tokens)
    return out


def renormalise(state: TrainState, loss_sum: torch.Tensor, loss_tokens: int | None) -> torch.Tensor:
    """A loss mask (data prepared with --chat): the microbatch losses were divided by every
    target of the global batch, the masked ones adding nothing (data.IGNORE); multiply the
    loss and the gradients by (all targets / counted targets), so both are normalised by the
    global count of counted targets (the same number at every mesh). Without a mask (or with
    every target counted) nothing is touched."""
    scale = loss_scale(state.recipe, loss_tokens)
    if scale == 1.0:
        return loss_sum
    torch._foreach_mul_([local(q.grad) for q in state.params if q.grad is not None], scale)
    return loss_sum * scale


def loss_scale(recipe, loss_tokens: int | None) -> float:
    """renormalise's factor: all targets / counted targets (1.0 without a mask or with every
    target counted; a batch with nothing to learn: loss 0, no gradient)."""
    full = recipe.training.global_batch_size * recipe.training.sequence_length
    return 1.0 if loss_tokens is None or loss_tokens == full else full / max(loss_tokens, 1)


def rank_batch(state: TrainState, source, step: int) -> tuple:
    """This rank's (inputs, targets) of global batch `step`: its samples (dp, ep) and its
    tokens of each (cp), on its device; with data.document_masking, then the dict of its
    tokens' position_ids and document_ids (and with MTP, its targets k ahead and mtp_ids,
    made from the whole windows before the cp split: training/mtp_loss.expand_batch)."""
    batch = mtp_loss.expand_batch(state.recipe, data.rank_samples(state.recipe, state.coords, source, step))
    return data.batch_to(context.shard_batch(batch, state.recipe.parallelism, state.coords), state.device)


def _banner(state: TrainState) -> str:
    n_local = sum(local(q).numel() for q in state.model.parameters())
    p, t = state.recipe.parallelism, state.recipe.training
    return (
        f"dtensor3d: world {dist.get_world_size()} {p.dims} on {state.device.type}, "
        f"{n_local} local params on rank 0, {t.steps} steps"
    )


def run_step(state: TrainState, source, guard: faults.Guard, found: list[hooks.StepHook]) -> dict:
    """One step of the loop: the train step (under the guard and every hook's context), the
    non-finite check, then every hook's after_step. Returns the step's metrics."""
    recipe, start = state.recipe, time.perf_counter()
    if is_rank0() and (note := epoch_note(source, recipe, state.step)):
        print(note, flush=True)  # the sample order enters a new epoch in this step
    with guard.step(state), hooks.during_step(found, state):
        batch = rank_batch(state, source, state.step)
        mixed = data.rank_sources(recipe, state.coords, source, state.step) if state.loss_rows is not None else None
        metrics = train_step(state, batch, data.loss_tokens(recipe, source, state.step), mixed)
    seconds = straggle(time.perf_counter() - start)  # DTENSOR3D_SLOW_RANK: a made straggler (tests)
    guard.check(metrics)
    with guard.after_step(state):
        for hook in found:
            hook.after_step(state, metrics, seconds)
    return metrics


def _close(found: list, guard) -> None:
    """The hooks, then the guard; once (a second call finds nothing left to close)."""
    while found:
        found.pop(0).close()
    guard.close()


def train(recipe: Recipe) -> list[dict]:
    """Train for recipe.training.steps; rank 0 logs. Returns the logged records. Preemption,
    non-finite steps and hung collectives go through faults.Guard; evaluation, the metrics
    log, checkpoints, profiling and the layout probe are step hooks (hooks.py)."""
    guard = faults.Guard(recipe)  # signal handlers before setup: a SIGTERM during it counts
    with guard.setup_phase():  # a rank missing or dead at the start: one line, not a traceback
        state = setup(recipe)
    found = hooks.hooks(state, compute_dtype_context)  # an async Saver's group: before the timeouts
    set_timeout(recipe.training.timeout_s)
    if recipe.logging.layout:
        write_layout(state.model, state.coords, dist.get_rank(), recipe.logging.run_dir)
    source, log = make_source(recipe), next(h.log for h in found if isinstance(h, hooks.MetricsLogging))
    if is_rank0():
        print(_banner(state), flush=True)
    try:
        while state.step < recipe.training.steps:
            run_step(state, source, guard, found)
            if guard.boundary(state, found):  # True: preempted (and saved, with checkpoint.dir)
                break
        for hook in found:
            hook.at_end(state)
    except faults.CollectiveError as e:
        raise SystemExit(faults.report_collective(e)) from None
    except UserError:  # a non-finite step under `stop`, a failed save: every rank stops here
        _close(found, guard)
        dist.destroy_process_group()  # torch's threads ended before exit (an exit with them alive could abort)
        raise
    finally:
        _close(found, guard)
    guard.final_barrier()  # every rank reached the end: only then the `done:` line
    if not guard.resizing:  # an elastic resize: the job goes on with new ranks
        log.done()
    dist.destroy_process_group()
    return log.records
