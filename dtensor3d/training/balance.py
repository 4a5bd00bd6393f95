"""Expert load per MoE layer, and aux-loss-free balancing (DeepSeek-V3's).

Each step every rank adds its MoE layers' routing records (tokens per expert, aux loss) into
one vector laid out by global MoE layer, summed over the world with the loss: the step's
global loads, the same numbers on every rank at any mesh. Balancing (model.router_bias_update_rate
= gamma > 0) then moves each layer's `e_score_correction_bias` by gamma * sign(mean load - load)
after the optimizer step: experts above the mean load get a lower selection score, those
below a higher one. The bias is a parameter without gradient (models/moe.py's Router), so
checkpoints, resharding and export carry it; the update is the same on every rank, each
applying it to the piece of the bias it holds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..models.moe import MoE
from ..parallel.expert import aux_loss_scale


def moe_layer_ids(cfg) -> list[int]:
    """The global indices of the layers with experts: the rows of the load table."""
    return [i for i in range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers) if cfg.is_moe_layer(i)]  # MTP too


def layer_moes(model: nn.Module) -> dict[int, MoE]:
    """This rank's MoE layers by global layer index (pipeline stages keep global names)."""
    return {int(name.split(".")[2]): m for name, m in model.named_modules() if isinstance(m, MoE)}


def step_stats(model: nn.Module, recipe, coords: dict[str, int], device: torch.device) -> torch.Tensor:
    """Step time: [aux loss term, tokens per expert of each MoE layer (layers x experts)...]
    of this rank's MoE layers this step (the last n-microbatches forwards of each), counted
    once over the ranks that share them (aux: tp and cp rank 0; loads: every rank, as each
    routes its own tokens, tp ranks included), to be summed over the world. [0] when the
    model has no experts."""
    m = recipe.model
    if not m.num_local_experts:
        return torch.zeros(1, device=device)
    rows = {layer: r for r, layer in enumerate(moe_layer_ids(m))}
    n_micro, scale = recipe.num_microbatches, aux_loss_scale(recipe)
    aux, loads = torch.zeros(1, device=device), torch.zeros(len(rows), m.num_local_experts, device=device)
    for layer, moe in layer_moes(model).items():
        for a, load in moe.take_records(n_micro):
            aux += a.to(device).float() * scale * (coords["tp"] == 0 and coords["cp"] == 0)
            loads[rows[layer]] += load.to(device)
    return torch.cat([aux, loads.reshape(-1)])


def max_over_mean(loads: torch.Tensor) -> torch.Tensor:
    """[layers, E] -> each layer's max / mean tokens per expert."""
    return loads.max(-1).values / loads.mean(-1).clamp_min(1e-9)


def stats_metrics(stats: torch.Tensor, recipe) -> dict:
    """The metrics of `step_stats` summed over the world: the aux loss, tokens per expert
    (all layers together), the worst layer's max/mean and each layer's; with balancing on,
    each layer's tokens per expert too (what the bias update read)."""
    loads = stats[1:].reshape(-1, recipe.model.num_local_experts)
    ratio = max_over_mean(loads)
    out = {
        "aux_loss": stats[0].item(),
        "tokens_per_expert": [int(round(x)) for x in loads.sum(0).tolist()],
        "expert_load_max_over_mean": ratio.max().item(),
        "expert_load_by_layer": [round(x, 4) for x in ratio.tolist()],
    }
    if recipe.model.router_bias_update_rate > 0:
        out["tokens_per_expert_by_layer"] = [[int(round(x)) for x in row] for row in loads.tolist()]
    return out


def bias_delta(loads: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's update for loads [layers, E]: rate * sign(mean load - load)."""
    return rate * torch.sign(loads.mean(-1, keepdim=True) - loads)


@torch.no_grad()
def update_router_bias(model: nn.Module, recipe, stats: torch.Tensor) -> None:
    """After the optimizer step: move every MoE layer's correction bias this rank holds by
    `bias_delta` of the step's global loads (from `step_stats` summed over the world)."""
    m = recipe.model
    if not m.router_bias_update_rate > 0:
        return
    loads = stats[1:].reshape(-1, m.num_local_experts)
    delta = bias_delta(loads, m.router_bias_update_rate)
    rows = {layer: r for r, layer in enumerate(moe_layer_ids(m))}
    for layer, moe in layer_moes(model).items():
        bias = moe.gate.e_score_correction_bias
        step = delta[rows[layer]].to(bias.dtype)
        if isinstance(bias, DTensor):  # FSDP's shard: the same full delta everywhere, sliced locally
            step = distribute_tensor(step.to(bias.device), bias.device_mesh, bias.placements, src_data_rank=None)
            bias.to_local().add_(step.to_local())
        else:
            bias.add_(step.to(bias.device))


def bias_ranges(model: nn.Module, recipe, device: torch.device) -> list[list[float]]:
    """[min, max] of each MoE layer's correction bias (one all-reduce over the world)."""
    rows = {layer: r for r, layer in enumerate(moe_layer_ids(recipe.model))}
    ext = torch.full((len(rows), 2), -float("inf"), device=device)  # [-min, max]
    for layer, moe in layer_moes(model).items():
        bias = moe.gate.e_score_correction_bias
        piece = (bias.to_local() if isinstance(bias, DTensor) else bias).float()
        if piece.numel():
            ext[rows[layer]] = torch.stack([-piece.min(), piece.max()]).to(device)
    dist.all_reduce(ext, op=dist.ReduceOp.MAX)
    return [[round(-lo, 6), round(hi, 6)] for lo, hi in ext.tolist()]


def load_warning(streaks: dict[int, int], by_layer: list[float], recipe) -> str | None:
    """Count, per MoE layer, the consecutive steps its max/mean exceeds
    logging.expert_load_warn; one line when a layer's count reaches expert_load_warn_steps."""
    lg, ids = recipe.logging, moe_layer_ids(recipe.model)
    if not lg.expert_load_warn:
        return None
    hit = []
    for layer, ratio in zip(ids, by_layer):
        streaks[layer] = streaks.get(layer, 0) + 1 if ratio > lg.expert_load_warn else 0
        if streaks[layer] == lg.expert_load_warn_steps:
            hit.append(f"{layer} ({ratio:.2f})")
    if not hit:
        return None
    return (
        f"warning: expert load max/mean above {lg.expert_load_warn:g} for {lg.expert_load_warn_steps} steps "
        f"in MoE layer(s) {', '.join(hit)}: the router may be collapsing"
    )
