"""What one training step costs each rank, from the recipe alone (no process group, no
hardware): parameters, gradients, optimizer state, activations and peak memory per
pipeline rank (its row "stage" is the pp coordinate; with several stages per rank --
interleaved_1f1b, zbv, dualpipev -- a row sums the rank's stages, as schedule_model.py
places them); FLOPs; bytes handed to each collective per mesh dim; the pipeline bubble.

Parameters are counted exactly and without torch (plan runs before anything starts): each
shape comes from dtensor3d/shapes.py (the model's table, checked against the meta model)
and is cut the way the code cuts it -- tp by the plan in parallel/tensor.py (Colwise: a
Linear's dim 0; Rowwise: a Linear's dim 1, the embedding's dim 0), experts on dim 0 over ep, then FSDP2's
dim-0 chunk over its group (rank 0 holds ceil(d0 / n) rows, the largest chunk). Storage is
the model's dtype (fp32; bf16 runs use autocast), so are gradients; AdamW keeps two moments
per element and one fp32 `step` scalar per parameter tensor. Under bf16 autocast (no FSDP)
the step also holds a bf16 copy of each linear's weight (`weight_copy_bytes`), except the
weights training.float8 converts: torchao's Float8Linear keeps its master weight.

Communication (`comm_bytes`) counts what each rank *hands* to collectives in one
steady-state step, as our code issues them: an all-gather counts the rank's input piece, a
reduce-scatter its whole input, an all-reduce the tensor, an all-to-all what it sends,
send/recv what it sends. Shape: {dim: {kind: bytes, ..., "total": bytes}} with dims tp, dp
(FSDP / replicate over the flattened ep x dp x cp and dp x cp groups), pp, cp, ep and world
(the step's one stats all-reduce), kinds as in KINDS. Widths as they go over the wire: under
bf16 autocast a matmul's output and its gradient are bf16 and the rest fp32; where FSDP2
gathers bf16 parameters every activation is bf16 (params.Sizes.act); gradients are reduced
in fp32. Recompute runs a layer's forward collectives again (`collectives.replays`: under
zbv / dualpipev with full recompute once per weight group in each split weight backward).
Expert all-to-all sizes depend on the routing; the count is the expected value under uniform
routing (the dispatch forward and the return's backward are exact; the return forward and
the dispatch backward are expected).
tests/dist_scripts/comm_bytes.py measures the same quantity by intercepting collectives.

Activation memory is a model, not an exact count: the tensors autograd keeps per decoder
layer (norm inputs and outputs in fp32, linear inputs, attention q/k/v/output/log-sum-exp,
the SwiGLU intermediates; under `recompute: full` only each layer's input, under
`selective` the input and the matmul outputs), the last stage's log-probabilities and,
under pp, what the schedule keeps (each stage's output per microbatch-stage in flight,
schedule_model.in_flight; per microbatch of the step, receive buffers and the last
stage's logits; under zbv's and dualpipev's split backward, what a stage holds between its
backward to the input and to the weights: `split_backward_bytes`, and with full recompute
the layer copies its weight backward recomputes, one per parameter tensor:
`weight_pass_bytes`). bench/plan_accuracy.py measures it."""

from __future__ import annotations

from .collectives import comm_bytes
from .memory import bubble_fraction, in_flight, stage_activation_bytes, weight_copy_bytes
from .muon_cost import muon_stage, optimizer_bytes
from .params import COMM_DIMS, FP32, Part, rank_parts, sizes, stage_units, unit_numels
from .reshard import resolve, resolve_here
from .shapes import flops_per_token

# -- memory and the whole estimate -------------------------------------------------------


def _fsdp_working_bytes(recipe, numels: dict[str, tuple[int, int]]) -> int:
    """Gathered parameters and unsharded gradients FSDP holds at the peak (the backward).
    Not resharded after forward (pp, or fsdp_reshard_after_forward never): the whole stage
    stays gathered for the step, each unit whole (its padded n x shard) in the compute dtype,
    with its whole unsharded fp32 gradients accumulated over the microbatches; the sharded
    gradients are none then (the step starts with zero_grad(set_to_none); the last
    backward's reduce-scatters remake them), so the stage's grad_bytes come off. Measured
    at dp 2 (auto: never resharded on this machine), step 2's peak of live bytes against the
    estimate: fp32 -12.8% -> -1.6%, bf16 / 8-bit states -14.4 / -14.8% -> -1.8 / -1.9%,
    bf16 -6.4% either way. The peak falls at the last backward's reduce-scatter, the
    gathered weights resharded: float8 tensorwise with its float8 all-gather measured the
    same peak as bf16 (2,833,632 against 2,833,520 B), so its 1-byte gathered weights
    (params.gather_bytes: what the all-gather sends) are not what this sum counts. Otherwise
    the root (gathered through the whole backward) and two units of `fsdp_bucket_layers`
    blocks (the current one and the prefetched one); gradients of every unit accumulate
    unsharded over the microbatches before the last, else only the root's and the current
    unit's."""
    p = recipe.parallelism
    if not p.fsdp_enabled:
        return 0
    whole = {name: gathered - held for name, (held, gathered) in numels.items()}
    if not p.reshard_after_forward:
        sharded = [name for name, (held, gathered) in numels.items() if gathered > held]
        full, held = sum(numels[name][1] for name in sharded), sum(numels[name][0] for name in sharded)
        return sizes(recipe).compute * full + FP32 * (full - held)
    root, n = whole.pop("root", 0), p.fsdp_bucket_layers
    blocks = sorted(whole.values(), reverse=True)
    grads = sum(blocks) if recipe.num_microbatches > 1 else sum(blocks[:n])
    return FP32 * (2 * root + sum(blocks[: 2 * n]) + grads)


def stage_estimate(recipe, part: Part, units: dict[str, dict]) -> dict:
    """One pp rank's row of the estimate (per rank with that pp coordinate; "stage" is the
    pp rank, "pp_stages" the global stages it holds, "stage_layers" their layer spans)."""
    numels = unit_numels(recipe, units)
    params = sum(held for held, _ in numels.values())
    tensors = sum(len(u["shapes"]) for u in units.values())
    per_micro, in_flight_bytes, once = stage_activation_bytes(recipe, part)
    layers = part.layers
    row = {
        "stage": part.rank,
        "pp_stages": list(part.stages),
        "layers": [layers[0], layers[-1]] if layers else [],
        "stage_layers": [[r.start, r.stop - 1] if len(r) else [] for r in part.stage_layers],
        "params": params,
        "param_bytes": params * FP32,
        "grad_bytes": params * FP32,
        "optimizer_bytes": optimizer_bytes(recipe, part.rank, params, tensors),  # AdamW's moments; Muon's buffers
        "activation_bytes_per_microbatch": per_micro,
        "microbatches_in_flight": in_flight(recipe, part.rank),
        "activation_bytes": in_flight_bytes + once,
        "weight_copy_bytes": weight_copy_bytes(recipe, part.rank),  # bf16 autocast's weight copies
    }
    if recipe.optimizer.name == "muon":  # plan/muon_cost.py: the owner-rank exchange, its bf16 matrices
        muon = muon_stage(recipe)[part.rank]
        row["muon_sent_bytes"] = muon["sent_bytes"] // (recipe.parallelism.world_size // recipe.parallelism.pp)
        row["muon_owner_bytes"] = muon["owner_bytes"]
    row["peak_bytes"] = (
        row["param_bytes"]
        + row["grad_bytes"]
        + row["optimizer_bytes"]
        + row["activation_bytes"]
        + row["weight_copy_bytes"]
        + _fsdp_working_bytes(recipe, numels)
    )
    return row


def flops_per_step(recipe) -> float:
    """Model FLOPs of one optimizer step (6N + attention per token; recomputation excluded)."""
    t = recipe.training
    return flops_per_token(recipe.model, t.sequence_length) * t.global_batch_size * t.sequence_length


def _busiest(per_stage: list[dict]) -> dict:
    """For each dim, the breakdown of the stage whose rank hands it the most bytes."""
    return {dim: max((s[dim] for s in per_stage), key=lambda k: k["total"]) for dim in COMM_DIMS}


def estimate(
    recipe, peak_tflops: float | None = None, mfu: float = 0.4, backend: str | None = None, resolve: bool = True
) -> dict:
    """The whole estimate (the JSON under `plan --json`'s key "estimate"); `fsdp_reshard_after_forward:
    auto` decided as this machine would (plan/reshard.py; resolve=False: taken as default)."""
    if resolve:
        recipe, _ = reshard_here(recipe)
    p, t = recipe.parallelism, recipe.training
    comm = comm_bytes(recipe, backend)
    stages = []
    for part, units in zip(rank_parts(recipe), stage_units(recipe)):
        row = stage_estimate(recipe, part, units)
        row["comm_bytes_per_step"] = comm[part.rank]
        stages.append(row)
    out = {
        "stages": stages,
        "flops_per_step": flops_per_step(recipe),
        "comm_bytes_per_step": _busiest(comm),
        "bubble_fraction": bubble_fraction(recipe),
    }
    if peak_tflops is not None:
        seconds = out["flops_per_step"] / (p.world_size * peak_tflops * 1e12 * mfu)
        out.update(
            peak_tflops=peak_tflops,
            mfu=mfu,
            step_time_s=seconds,
            tokens_per_sec=t.global_batch_size * t.sequence_length / seconds,
        )
    return out


def peak_bytes(recipe) -> int:
    """The largest peak of any pp rank (`fsdp_reshard_after_forward` as the recipe says)."""
    return max(s["peak_bytes"] for s in estimate(recipe, resolve=False)["stages"])


def resolve_reshard(recipe, device_bytes: int | None):
    """plan/reshard.py's `resolve` with this estimate's peak: (recipe with auto decided, its line)."""
    return resolve(recipe, device_bytes, peak_bytes)


def reshard_here(recipe):
    """plan/reshard.py's `resolve_here` with this estimate's peak (on CPU: this machine's memory)."""
    return resolve_here(recipe, peak_bytes)
