"""The estimate's communication: bytes handed to each collective kind per mesh dim and step
(tp per layer, FSDP/replicate per unit, pp sends, cp's gathers, ep's all-to-alls), exact
against what parallel/comm.py counts on real runs. Pure Python."""

from __future__ import annotations

from ..config.low_precision import float8_all_gather
from ..config.parallelism import window_tails
from ..config.schema import V_SCHEDULES
from .float8_comm import cp_scale_bytes, fsdp_scale_tp_bytes, tp_scale_bytes, tp_weight_pass_bytes
from .memory import _moe_layers
from .params import (
    FP32,
    KINDS,
    Part,
    gather_bytes,
    param_table,
    rank_parts,
    shard_numel,
    sizes,
    stage_units,
    unit_numels,
)
from .schedule_model import sends_per_microbatch, weight_passes
from .shapes import weight_groups

# -- communication -----------------------------------------------------------------------


def chunked_async(recipe) -> bool:
    """tp_linear_async_communication runs parallel/async_tp.py's Functions: its choice in
    parallel/tensor.py's tp_overlap, "chunked" (CUDA under training.compile with sequence
    parallelism takes inductor's micro-pipeline rewrite of the sync plan instead, counted
    as the sync plan)."""
    p, t = recipe.parallelism, recipe.training
    if not (p.tp_enabled and p.tp_linear_async_communication):
        return False
    return not (t.device == "cuda" and t.compile and p.sequence_parallel)


def _kinds(**bytes_by_kind: int) -> dict[str, int]:
    out = {k: int(bytes_by_kind.get(k, 0)) for k in KINDS}
    out["total"] = sum(out.values())
    return out


def _tp_layer(recipe, moe: bool) -> tuple[dict, dict]:
    """(forward, backward) tp bytes of one decoder layer and one microbatch. An MoE layer
    routes this rank's share of the tokens (parallel/expert.py): it all-reduces its routing
    sums (2E + 1 floats) forward and backward, and under ALL_REDUCE all-gathers its outputs
    forward and its input's gradient backward (ceil(tokens / tp) rows each)."""
    p, z = recipe.parallelism, sizes(recipe)
    full_c, full_f = z.tokens * z.hidden * z.compute, z.tokens * z.hidden * z.act
    part_c, part_f = z.seq_tokens * z.hidden * z.compute, z.seq_tokens * z.hidden * z.act
    blocks = 1 if moe else 2  # attention, and the dense feed-forward (experts are replicated over tp)
    # A column group's input gradient: x's dtype (DTensor reduces the gradient of x), but the
    # async path reduces its matmul's output (compute width: bf16 under autocast, which the
    # trainer's backward runs under too; measured 4,096 B per 32 x 64 all-reduce)
    grad_in = full_c if chunked_async(recipe) else full_f
    if not p.sequence_parallel:
        # Rowwise outputs are all-reduced forward; backward, one summed input gradient per
        # q/k/v or gate/up group (MLA's attention, which the async key refuses: q/k/v's three,
        # which _mla_backward replaces).
        colwise = blocks + 2 * bool(recipe.model.mla)
        fwd, bwd = {"all_reduce": blocks * full_c}, {"all_reduce": colwise * grad_in}
    else:
        fwd = {"all_gather": blocks * part_f, "reduce_scatter": blocks * full_c}
        bwd = {"all_gather": blocks * part_c, "reduce_scatter": blocks * grad_in}
    if recipe.model.qk_norm_whole:  # q and k's sums of squares over the whole projection (WholeProjectionNorm)
        fwd["all_reduce"] = fwd.get("all_reduce", 0) + 2 * z.tokens * FP32
        bwd["all_reduce"] = bwd.get("all_reduce", 0) + 2 * z.tokens * FP32
    if moe:
        stats = (2 * recipe.model.num_local_experts + 1) * z.router
        fwd["all_reduce"] = fwd.get("all_reduce", 0) + stats
        bwd["all_reduce"] = bwd.get("all_reduce", 0) + stats
        if not p.sequence_parallel:
            rows = -(-z.tokens // p.tp) * z.hidden * z.act  # in x's dtype (fp32 under autocast)
            fwd["all_gather"], bwd["all_gather"] = rows, rows
    return fwd, _mla_backward(recipe, bwd) if recipe.model.mla else bwd


def _mla_backward(recipe, bwd: dict) -> dict:
    """A multi-head latent attention layer's backward tp bytes from a Llama layer's: its
    attention takes its (gathered) input as a plain tensor, so instead of q/k/v's input
    gradients (ALL_REDUCE; sequence parallelism: the gather's reduce-scatter, which now only
    slices) it all-reduces those of the up projections' inputs (q_b_proj's latent, or
    q_proj's whole input; kv_b_proj's latent) and of the shared RoPE key
    (parallel/tensor.py SharedKeyGradient)."""
    p, z, m = recipe.parallelism, sizes(recipe), recipe.model
    q_in = m.q_lora_rank * z.compute if m.q_lora_rank else z.hidden * z.act
    ar = z.tokens * (q_in + (m.kv_lora_rank + m.qk_rope_head_dim) * z.compute)
    full_f = z.tokens * z.hidden * z.act
    if p.sequence_parallel:
        return {**bwd, "reduce_scatter": bwd["reduce_scatter"] - full_f, "all_reduce": bwd.get("all_reduce", 0) + ar}
    return {**bwd, "all_reduce": bwd["all_reduce"] - 3 * full_f + ar}


def replays(recipe, stage: int, layer: int) -> int:
    """Per step: how many times backward runs the forward collectives of decoder layer
    `layer` (on global pipeline stage `stage`) again. None without recompute; once per
    microbatch under full, and under selective too (its policy keeps only matmul outputs; the
    gathered inputs those matmuls' backward reads are recomputed, collectives included --
    counted on tp2 sp x cp2). Under zbv and dualpipev with full recompute, on every stage but
    the first, also once per weight group of the layer (shapes.weight_groups) in each weight
    backward W (schedule_model.weight_passes): torch computes W with one autograd.grad per
    parameter group, each a new graph task, and torch.utils.checkpoint recomputes the layer
    for every graph task that reads its saved tensors (memory.weight_pass_bytes counts the
    copies). The first stage's input needs no gradient: torch runs its backward whole.
    Measured on tp2 sp x pp2 with 8 microbatches: a parity layer (9 weight groups) on stage
    1 replays 8 + 8 x 9 times under zbv, 8 + 1 x 9 under dualpipev."""
    p, m = recipe.parallelism, recipe.num_microbatches
    if p.recompute == "none":
        return 0
    if p.recompute != "full":
        return m
    return m + split_passes(recipe, stage) * _weight_groups(recipe, layer)


def split_passes(recipe, stage: int) -> int:
    """Weight backwards W of global pipeline stage `stage` per step (none on the first
    stage, whose backward torch runs whole)."""
    p = recipe.parallelism
    if not p.pp_enabled or p.pp_engine not in V_SCHEDULES or stage == 0:
        return 0
    return weight_passes(p, recipe.num_microbatches, stage)


def _weight_groups(recipe, layer: int) -> int:
    """shapes.weight_groups, where the async tp path (parallel/async_tp.py) computes q/k/v's
    (and a dense layer's gate/up's) weight gradients in one autograd Function: one group each
    (torch groups parameters by the node where they meet the activations)."""
    m = recipe.model
    merged = 0
    if chunked_async(recipe):
        merged = 2 + (not (m.num_local_experts and m.is_moe_layer(layer)))
    return weight_groups(m, layer) - merged


def _layer_runs(recipe, part: Part):
    """(is an MoE layer, replays per step, weight backwards per step) for each decoder layer
    of this pp rank."""
    m = recipe.model
    for stage, layers in zip(part.stages, part.stage_layers):
        for i in layers:
            yield (
                bool(m.num_local_experts) and m.is_moe_layer(i),
                replays(recipe, stage, i),
                split_passes(recipe, stage),
            )


def layers_in_order(part: Part) -> list[int]:
    """The rank's decoder layers in _layer_runs' order (its stages', each in order)."""
    return [i for layers in part.stage_layers for i in layers]


def _tp_replay(recipe, fwd: dict, moe: bool) -> dict:
    """A layer's forward collectives that full recompute runs again in backward. Recompute
    stops once every tensor backward needs is back (torch's non-reentrant checkpoint), so a
    dense layer's last collective -- the feed-forward's output all-reduce (reduce-scatter
    under sequence parallelism), whose result backward never reads -- is not repeated. An
    MoE layer's routing sums are read by its aux loss's backward: repeated; under ALL_REDUCE
    its last collective, the outputs' all-gather, is not. With a norm after the feed-forward
    (OLMo 2, Gemma 3) backward reads that output too: every collective is repeated."""
    z, p = sizes(recipe), recipe.parallelism
    if recipe.model.post_norms or recipe.model.sandwich_norms:
        return fwd  # a norm after the feed-forward reads its reduced output: recompute runs that too
    if moe:
        return {k: n for k, n in fwd.items() if k != "all_gather" or p.sequence_parallel}
    if p.sequence_parallel and chunked_async(recipe):
        # the async row linear is one autograd Function: its saved tensors are packed once it
        # returns, after its reduce-scatter, so recompute runs that too
        return fwd
    last = "reduce_scatter" if p.sequence_parallel else "all_reduce"
    return {**fwd, last: fwd[last] - z.tokens * z.hidden * z.compute}


def _async_weight_pass(recipe, moe: bool) -> dict:
    """A layer's collectives in each weight backward W of the async tp path: under sequence
    parallelism each row linear's Function (o; a dense layer's down) gathers its output
    gradient again, which its weight gradient reads. A column group's W skips its input
    gradient and that gradient's collective (async_tp._input_grad_wanted)."""
    p, z = recipe.parallelism, sizes(recipe)
    if not (chunked_async(recipe) and p.sequence_parallel):
        return {}
    return {"all_gather": (1 if moe else 2) * z.seq_tokens * z.hidden * z.compute}


def _sum(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return _kinds(**{k: a.get(k, 0) + b.get(k, 0) for k in KINDS})


def _add(total: dict, part: dict, times: int = 1) -> None:
    for kind, n in part.items():
        total[kind] = total.get(kind, 0) + n * times


def tp_bytes(recipe, part: Part) -> dict[str, int]:
    """Per step: DTensor collectives of the tp plan (parallel/tensor.py), per microbatch:
    each layer's, the embedding's, the head's and loss_parallel's three fp32 all-reduces over
    the tokens (max, sum of exp, target logit); matmul outputs at the compute width, other
    activations at `Sizes.act`; a layer's forward again as often as `replays` says; per step
    under sequence parallelism, the all-reduce of the norm weights' gradients
    (`match_grad_placements`), and with per-head q/k norms (Qwen3) theirs at either tp mode."""
    p, z = recipe.parallelism, sizes(recipe)
    if not p.tp_enabled:
        return _kinds()
    layers, per_micro, per_step = part.layers, {}, {}
    for (moe, again, split), i in zip(_layer_runs(recipe, part), layers_in_order(part)):
        fwd, bwd = _tp_layer(recipe, moe)
        scales = tp_scale_bytes(recipe, i)  # training.float8: torchao's amax all-reduces (plan/float8_comm.py)
        fwd["all_reduce"], bwd["all_reduce"] = (
            fwd.get("all_reduce", 0) + scales[0],
            bwd.get("all_reduce", 0) + scales[1],
        )
        _add(per_micro, fwd)
        _add(per_micro, bwd)
        _add(per_step, _tp_replay(recipe, fwd, moe), again)
        _add(per_step, _async_weight_pass(recipe, moe), split)
        _add(per_step, {"all_reduce": tp_weight_pass_bytes(recipe, i)}, split)  # float8's casts in each W
    full_f, part_f = z.tokens * z.hidden * z.act, z.seq_tokens * z.hidden * z.act
    depth = recipe.model.num_nextn_predict_layers if part.last else 0  # MTP: each depth's embedding and head
    embedding = {"reduce_scatter": full_f, "all_gather": part_f} if p.sequence_parallel else {"all_reduce": full_f}
    _add(per_micro, embedding, part.first + depth)  # vocab-parallel embedding: its partial output is reduced
    if part.last:  # column-parallel head; loss_parallel's reductions (the main head's, then each depth's)
        head = {"all_gather": part_f, "reduce_scatter": full_f} if p.sequence_parallel else {"all_reduce": full_f}
        _add(per_micro, head, 1 + depth)
        _add(per_micro, {"all_reduce": 3 * z.tokens * FP32}, 1 + depth)
    _add(per_step, per_micro, recipe.num_microbatches)
    width = _norm_grad_width(recipe)
    if p.sequence_parallel:  # the norms' replicated weights: partial gradients summed once per step
        norms = 2 * len(layers) + part.last + 3 * depth  # MTP: enorm, hnorm, shared_head.norm; and eh_proj
        _add(per_step, {"all_reduce": (norms * z.hidden + depth * 2 * z.hidden * z.hidden) * width})
    if recipe.model.qk_norm and not recipe.model.qk_norm_whole:
        # per-head q/k norms see this rank's heads: their gradients summed too
        _add(per_step, {"all_reduce": 2 * len(layers) * recipe.model.head_dim * width})
    _add(per_step, {"all_reduce": moe_grad_numel(recipe, part) * FP32})
    _add(per_step, {"all_reduce": fsdp_scale_tp_bytes(recipe, layers)})
    return _kinds(**per_step)


def _norm_grad_width(recipe) -> int:
    """Bytes per element of the norms' partial gradients when they are summed over tp. FSDP2
    sums them (its redistribution to the parameter's placements, before its reduce-scatter)
    in the gradient's own dtype: bf16 where it gathers bf16 parameters and the step has one
    microbatch; with more it accumulates the unsharded gradients in its fp32 reduce dtype
    first. Measured: dp2 x tp2 sequence parallel bf16, 1 microbatch per step (9 norms x 64
    x 2 B) against 4 (x 4 B)."""
    p, t = recipe.parallelism, recipe.training
    return 2 if t.dtype == "bfloat16" and p.fsdp_enabled and recipe.num_microbatches == 1 else FP32


def moe_grad_numel(recipe, part: Part) -> int:
    """Elements of the MoE gradients this rank sums over tp once per step
    (parallel/expert.sum_tp_grads): its pieces of the routers, experts and shared experts
    (FSDP's chunk on rank 0 where FSDP shards them; the correction bias has no gradient)."""
    fsdp = recipe.parallelism.fsdp_enabled
    if not recipe.model.num_local_experts:  # a dense model has none (and its table is not built per layer)
        return 0
    return sum(
        shard_numel(row["shape"], row["group"] if fsdp else 1)
        for name, row in param_table(recipe).items()
        if row["stage"] == part.rank and ".block_sparse_moe." in name and not name.endswith("correction_bias")
    )


def dp_bytes(recipe, units: dict[str, dict]) -> dict[str, int]:
    """Per step. FSDP2: every unit all-gathers its shard for each forward and (resharded
    after forward) each backward -- twice per microbatch; under pp (or
    fsdp_reshard_after_forward never) parameters stay gathered for the whole step: once --
    in the compute dtype (bf16 training gathers bf16 parameters: FSDP2's
    MixedPrecisionPolicy; a float8-gathered weight in 1 byte, params.gather_bytes, and after
    the optimizer one fp32 all-reduce of their scales' amaxes), and reduce-scatters its whole
    fp32 gradient once; under dp_mode
    hybrid within ep x dp_shard x cp, then all-reduces the shard across the
    dp_replicate replicas. Replicate: one all-reduce of the gradients (dense over
    ep x dp x cp, experts over dp x cp)."""
    p = recipe.parallelism
    grads = unit_numels(recipe, units, grads=True)
    if p.fsdp_enabled:
        gathers = 2 * recipe.num_microbatches if p.reshard_after_forward else 1
        sharded = [name for name, u in units.items() if u["group"] > 1]
        replicas = p.dp_replicate if p.hsdp_enabled else 1  # HSDP all-reduces the shards across replicas
        scales = sum(len(units[name]["float8"]) for name in sharded) * float8_all_gather(recipe.training, p)
        return _kinds(
            all_gather=gathers * sum(gather_bytes(recipe, units)[name] for name in sharded),
            reduce_scatter=FP32 * sum(grads[name][1] for name in sharded),
            all_reduce=FP32 * (sum(grads[name][0] for name in sharded) * (replicas > 1) + scales),
        )
    if p.replicate_enabled:
        return _kinds(all_reduce=FP32 * sum(grads[name][0] for name, u in units.items() if u["group"] > 1))
    return _kinds()


def pp_bytes(recipe, part: Part) -> dict[str, int]:
    """Per step: each microbatch's residual stream (fp32; bf16 where FSDP2 gathers bf16
    parameters: `Sizes.act`) sent from each of the rank's stages to the next stage and its
    gradient to the previous one, where that stage is on another rank
    (schedule_model.sends_per_microbatch)."""
    z = sizes(recipe)
    sends = sends_per_microbatch(recipe.parallelism, part.rank)
    return _kinds(send_recv=sends * recipe.num_microbatches * z.seq_tokens * z.hidden * z.act)


def cp_bytes(recipe, part: Part, backend: str) -> dict[str, int]:
    """Per step: each attention all-gathers its k and v (again as often as `replays` says),
    and with data.document_masking its tokens' int64 document ids (a sliding window's layer: only
    the chunks' tails, `cp_gathered_tokens`); backward reduce-scatters the k, v gradients (gloo:
    all-reduces them). MoE layers all-reduce their routing sums
    (2E + 1 floats) forward (and in each replay) and backward, and float8 tensorwise each
    converted linear's input and output-gradient amax (plan/float8_comm.cp_scale_bytes)."""
    p, z, m = recipe.parallelism, sizes(recipe), recipe.model
    if not p.cp_enabled:
        return _kinds()
    stats = (2 * m.num_local_experts + 1) * z.router
    bwd_kind = "reduce_scatter" if backend == "nccl" else "all_reduce"
    mb, per_step = recipe.num_microbatches, {"all_gather": 0, bwd_kind: 0, "all_reduce": 0}
    for (moe, again, _), i in zip(_layer_runs(recipe, part), layers_in_order(part)):
        tokens = cp_gathered_tokens(recipe, i)  # this rank's keys that go out (all: times cp)
        kv = tokens * z.kv_pair * z.compute + (tokens * 8 if recipe.data.document_masking else 0)
        per_step["all_gather"] += (mb + again) * kv
        per_step[bwd_kind] += mb * tokens * p.cp * z.kv_pair * z.compute
        per_step["all_reduce"] += (2 * mb + again) * stats * moe
        per_step["all_reduce"] += (2 * mb + again) * cp_scale_bytes(recipe, i)  # float8 tensorwise's amaxes
    return _kinds(**per_step)


def cp_gathered_tokens(recipe, layer: int) -> int:
    """Tokens of a microbatch whose keys and values this rank hands to cp's all-gather in
    decoder layer `layer`: all it holds, or under a sliding window that fits in a zigzag chunk
    only the last window - 1 of each of its two chunks (config.parallelism.window_tails)."""
    t = recipe.training
    tails = window_tails(recipe.model.layer_window(layer), t.sequence_length, recipe.parallelism.cp)
    return t.micro_batch_size * 2 * tails if tails else sizes(recipe).tokens


def ep_bytes(recipe, part: Part) -> dict[str, int]:
    """Per step, expected under uniform routing: per MoE layer and forward (and each replay,
    `replays`) the int64 token counts (E), the routed tokens out (`Sizes.act`) and back
    (compute dtype); backward the same two ways for the gradients."""
    p, z, m = recipe.parallelism, sizes(recipe), recipe.model
    if not p.ep_enabled:
        return _kinds()
    rows = z.tokens * m.num_experts_per_tok * z.hidden
    fwd = m.num_local_experts * 8 + rows * (z.act + z.compute)
    bwd = rows * (z.compute + z.act)
    mb = recipe.num_microbatches
    return _kinds(all_to_all=sum(((mb + again) * fwd + mb * bwd) * moe for moe, again, _ in _layer_runs(recipe, part)))


def tied_bytes(recipe, part: Part, units: dict[str, dict]) -> dict[str, int]:
    """Per step: a tied model split into pipeline stages sums the gradient of its two copies
    of the embedding (parallel/tied.py): one all-reduce of this rank's piece over the
    embedding group, on the first- and the last-stage rank when they differ (none under a V
    schedule, where one rank holds both)."""
    p, m = recipe.parallelism, recipe.model
    if not ((m.tie_word_embeddings or m.num_nextn_predict_layers) and p.pp_enabled) or part.first == part.last:
        return _kinds()
    shape = param_table(recipe)["model.embed_tokens.weight"]["shape"]
    group = units["root"]["group"] if p.fsdp_enabled else 1
    return _kinds(all_reduce=FP32 * shard_numel(shape, group))


def world_bytes(recipe) -> dict[str, int]:
    """The step's world all-reduce: loss, squared grad norm, aux loss, tokens per expert of
    each MoE layer; with balancing on, a second one of each MoE layer's bias [-min, max]; the
    z-loss's sum (train.train_step's last slot, zero when training.z_loss is 0)."""
    m = recipe.model
    depth = m.num_nextn_predict_layers  # MTP blocks route too; and the step's [main, CE_1..CE_D] (mtp_loss.py)
    n_moe = _moe_layers(recipe, range(m.num_hidden_layers + depth))
    balance = 2 * n_moe * (m.router_bias_update_rate > 0)
    mtp = (1 + depth) * (depth > 0)
    return _kinds(all_reduce=(3 + n_moe * m.num_local_experts + balance + mtp + 1) * FP32)


def comm_bytes(recipe, backend: str | None = None) -> list[dict[str, dict[str, int]]]:
    """Per pp rank: {dim: {kind: bytes, "total": bytes}} each rank with that pp coordinate
    hands to collectives in one steady-state step. backend: "gloo" or "nccl" (default: from
    training.device; cp's backward differs). This is the count tests compare with
    tests/dist_scripts/comm_bytes.py. `fsdp_reshard_after_forward: auto` counts as default here:
    decide it first (estimate.reshard_here, as estimate() does)."""
    backend = backend or ("gloo" if recipe.training.device == "cpu" else "nccl")
    out = []
    for part, units in zip(rank_parts(recipe), stage_units(recipe)):
        out.append(
            {
                "tp": tp_bytes(recipe, part),
                "dp": dp_bytes(recipe, units),
                "pp": _sum(pp_bytes(recipe, part), tied_bytes(recipe, part, units)),
                "cp": cp_bytes(recipe, part, backend),
                "ep": ep_bytes(recipe, part),
                "world": world_bytes(recipe),
            }
        )
    return out
