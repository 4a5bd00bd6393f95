"""The training loop: a recipe becomes an explicit TrainState; `train_step(state, batch)`
does one optimizer step and returns its metrics.

Build order (DESIGN.md): mesh -> model on meta -> pipeline stage -> tp -> activation
checkpointing -> fsdp -> materialise + topology-independent init -> optimizer -> schedule.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import socket
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

from . import checkpoint
from .datasets.sources import make_source
from .mesh import build_mesh, mesh_axis
from .metrics import MetricsLog, flops_per_token, peak_flops, peak_memory_gib
from .models.llama import LlamaForCausalLM, init_std
from .optim import build_optimizer, clip_, grad_sq_partial, lr_at, replication
from .parallel.context import apply_cp, shard_sequence
from .parallel.data import allreduce_grads, apply_fsdp, local_batch
from .parallel.expert import apply_ep, moe_modules
from .parallel.pipeline import build_schedule, split_stage
from .parallel.shards import local
from .parallel.tensor import apply_tp


@dataclass
class TrainState:
    recipe: object
    mesh: object
    device: torch.device
    coords: dict[str, int]
    model: nn.Module  # this rank's model part (the whole model when pp == 1)
    optimizer: torch.optim.Optimizer
    schedule: object | None
    loss_fn: object
    params: list[nn.Parameter]
    norm_weights: list[float]  # 1 / replication of each parameter, for the global grad norm
    step: int = 0
    extras: dict = field(default_factory=dict)

    @property
    def is_last_stage(self) -> bool:
        return self.coords["pp"] == self.recipe.parallelism.pp - 1


def resolve_device(choice: str) -> str:
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device_type: str) -> torch.device:
    """Join (or, outside torchrun, create a 1-process) default group; return this rank's device."""
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
        )
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return device


def param_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Topology-independent init: each full parameter is drawn from its own generator seeded
    by (seed, name), on the CPU, then this rank keeps its slice. Same bits at any mesh."""
    for name, p in model.named_parameters():
        std = init_std(name)
        if std is None:
            full = torch.ones(p.shape)
        else:
            full = torch.randn(p.shape, generator=torch.Generator().manual_seed(param_seed(seed, name))) * std
        full = full.to(device=local(p).device, dtype=p.dtype)
        if isinstance(p, DTensor):
            full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
        local(p).copy_(full)


def build_model(recipe, mesh, device: torch.device, coords: dict[str, int]) -> nn.Module:
    """This rank's part of the model, parallelised and initialised."""
    p, cfg = recipe.parallelism, recipe.model
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    if p.pp > 1:
        split_stage(model, coords["pp"], p, cfg.num_hidden_layers)
    if p.tp > 1:
        apply_tp(model, mesh["tp"], p)
    if p.cp > 1:
        apply_cp(model, mesh["cp"], recipe.training.sequence_length, device)
    if p.ep > 1:
        apply_ep(model, mesh["ep"])
    for moe in moe_modules(model):
        moe.stats_group = mesh["cp"].get_group() if p.cp > 1 else None
        moe.aux_scale = cfg.router_aux_loss_coef / (
            recipe.training.global_batch_size // recipe.training.micro_batch_size
        )
    if p.recompute_layer:
        for block in model.model.layers.values():
            block.recompute = True
    if p.ep * p.dp * p.cp > 1 and p.dp_mode == "shard":
        apply_fsdp(model, mesh_axis(mesh, "ep_dp_cp"), mesh_axis(mesh, "dp_cp"), reshard_after_forward=p.pp == 1)
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    init_weights(model, recipe.training.seed)
    return model


def make_loss_fn(global_tokens: int):
    """Sum of token losses / tokens in the whole global batch: the same number at any mesh,
    and gradients that only need summing across ranks and microbatches."""

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), reduction="sum") / global_tokens

    return loss_fn


def setup(recipe) -> TrainState:
    device = init_distributed(resolve_device(recipe.training.device))
    torch.manual_seed(recipe.training.seed)
    mesh = build_mesh(recipe.parallelism, device.type)
    coords = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    model = build_model(recipe, mesh, device, coords)
    t, p = recipe.training, recipe.parallelism
    loss_fn = make_loss_fn(t.global_batch_size * t.sequence_length)
    schedule = None
    if p.pp > 1:
        schedule = build_schedule(model, coords["pp"], mesh["pp"], device, p, recipe.num_microbatches, loss_fn)
    optimizer = build_optimizer([model], recipe.optimizer)
    params = [q for q in model.parameters() if q.requires_grad]
    world = dist.get_world_size()
    weights = [1.0 / replication(q, world, p.pp) for q in params]
    state = TrainState(recipe, mesh, device, coords, model, optimizer, schedule, loss_fn, params, weights)
    checkpoint.load_at_start(state)  # resume (model, optimizer, step, RNG) or Hugging Face init
    return state


def _compute_context(state: TrainState):
    stack = contextlib.ExitStack()
    if state.recipe.parallelism.tp > 1:
        stack.enter_context(loss_parallel())
    if state.recipe.training.dtype == "bfloat16":
        stack.enter_context(torch.autocast(state.device.type, dtype=torch.bfloat16))
    return stack


def _forward_backward(state: TrainState, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Run every microbatch of this rank's local batch; return the sum of its losses (zero
    where this rank computes none)."""
    p, mbs = state.recipe.parallelism, state.recipe.training.micro_batch_size
    total = torch.zeros((), device=state.device)
    with _compute_context(state):
        if state.schedule is not None:
            losses: list[torch.Tensor] = []
            first, last = state.coords["pp"] == 0, state.is_last_stage
            args = (inputs,) if first else ()
            state.schedule.step(*args, target=targets if last else None, losses=losses if last else None)
            for loss in losses:
                total += local(loss.detach()).float()
            return total
        fsdp = p.dp * p.cp > 1 and p.dp_mode == "shard"
        n_micro = inputs.shape[0] // mbs
        for m in range(n_micro):
            if fsdp:
                state.model.set_requires_gradient_sync(m == n_micro - 1)
            rows = slice(m * mbs, (m + 1) * mbs)
            loss = state.loss_fn(state.model(inputs[rows]), targets[rows])
            loss.backward()
            total += local(loss.detach()).float()
    return total


def _match_grad_placements(params: list[nn.Parameter]) -> None:
    """Give each DTensor gradient its parameter's placements. (A vocab-parallel embedding's
    gradient comes back replicated over tp; slicing it is local, no communication.)"""
    for q in params:
        if isinstance(q.grad, DTensor) and q.grad.placements != q.placements:
            q.grad = q.grad.redistribute(q.device_mesh, q.placements)


def train_step(state: TrainState, batch: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """One optimizer step over one global batch; returns loss, grad_norm and lr."""
    recipe, p = state.recipe, state.recipe.parallelism
    state.optimizer.zero_grad(set_to_none=True)
    loss_sum = _forward_backward(state, *batch)
    _match_grad_placements(state.params)
    if p.dp_mode == "replicate":
        experts = {id(q) for m in moe_modules(state.model) for q in m.experts.parameters()}
        allreduce_grads(
            [q for q in state.params if id(q) not in experts], mesh_axis(state.mesh, "ep_dp_cp").get_group()
        )
        allreduce_grads([q for q in state.params if id(q) in experts], mesh_axis(state.mesh, "dp_cp").get_group())
    # One world all-reduce carries the loss (from the last stage's tp-rank-0 ranks), the
    # squared grad norm (each copy weighted by 1 / its replication) and the MoE statistics.
    reports_loss = state.is_last_stage and state.coords["tp"] == 0
    stats = torch.cat(
        [
            torch.stack([loss_sum * reports_loss, grad_sq_partial(state.params, state.norm_weights).to(state.device)]),
            _moe_stats(state),
        ]
    )
    dist.all_reduce(stats)
    loss, grad_norm = stats[0].item(), math.sqrt(stats[1].item())
    clip_(state.params, grad_norm, recipe.optimizer.clip_grad)
    lr = lr_at(state.step, recipe.optimizer, recipe.training.steps)
    for group in state.optimizer.param_groups:
        group["lr"] = lr
    state.optimizer.step()
    state.step += 1
    metrics = {"step": state.step, "loss": loss, "grad_norm": grad_norm, "lr": lr}
    if recipe.model.num_local_experts:
        load = stats[3:]
        metrics.update(
            aux_loss=stats[2].item(),
            tokens_per_expert=[int(round(x)) for x in load.tolist()],
            expert_load_max_over_mean=(load.max() / load.mean().clamp_min(1e-9)).item(),
        )
    return metrics


def _moe_stats(state: TrainState) -> torch.Tensor:
    """[aux loss term, tokens per expert...] of this rank's MoE layers this step (the last
    n-microbatches forwards of each), counted once over the ranks that share them (aux: tp
    and cp rank 0; loads: tp rank 0). Clears the records."""
    cfg, c = state.recipe.model, state.coords
    n_micro = state.recipe.num_microbatches
    out = torch.zeros(1 + cfg.num_local_experts, device=state.device)
    for moe in moe_modules(state.model):
        for aux, load in moe.records[-n_micro:]:
            if c["tp"] == 0:
                out[0] += aux.to(out.device).float() * moe.aux_scale * (c["cp"] == 0)
                out[1:] += load.to(out.device)
        moe.records.clear()
    return out


def batch_rank(state: TrainState) -> tuple[int, int]:
    """(this rank's index among the ranks that split the batch, their count): ep x dp."""
    p, c = state.recipe.parallelism, state.coords
    return c["ep"] * p.dp + c["dp"], p.ep * p.dp


def rank_batch(state: TrainState, source, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, targets) of global batch `step`: its samples (ep x dp) and, under
    context parallelism, its two chunks of every sequence."""
    inputs, targets = local_batch(state.recipe, source, step, *batch_rank(state))
    cp = state.recipe.parallelism.cp
    if cp > 1:
        inputs, targets = (shard_sequence(x, cp, state.coords["cp"]) for x in (inputs, targets))
    return inputs.to(state.device), targets.to(state.device)


def train(recipe) -> list[dict]:
    """Train for recipe.training.steps; rank 0 logs. Returns the logged records."""
    state = setup(recipe)
    t = recipe.training
    rank = dist.get_rank()
    log = MetricsLog(recipe.logging.run_dir, recipe.to_dict(), enabled=rank == 0, resume=state.step)
    source = make_source(recipe)
    tokens = t.global_batch_size * t.sequence_length
    fpt, peak = flops_per_token(recipe.model, t.sequence_length), peak_flops(state.device)
    if rank == 0:
        print(
            f"dtensor3d: world {dist.get_world_size()} {recipe.parallelism.dims} on {state.device.type}, "
            f"{sum(local(q).numel() for q in state.model.parameters())} local params on rank 0, {t.steps} steps",
            flush=True,
        )
    try:
        while state.step < t.steps:
            start = time.perf_counter()
            metrics = train_step(state, rank_batch(state, source, state.step))
            elapsed = time.perf_counter() - start
            if state.step % recipe.logging.every == 0 or state.step == t.steps:
                tps = tokens / elapsed
                metrics.update(
                    tokens_per_sec=tps,
                    ms_per_step=1000 * elapsed,
                    peak_mem_gib=peak_memory_gib(state.device),
                    mfu=tps * fpt / (peak * dist.get_world_size()) if peak else None,
                )
                log.log(metrics)
            if checkpoint.checkpoint_due(recipe, state.step):
                checkpoint.save(state)
    finally:
        log.close()
    dist.barrier()
    dist.destroy_process_group()
    return log.records
