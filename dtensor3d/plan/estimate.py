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
per element and one fp32 `step` scalar per parameter tensor.

Communication (`comm_bytes`) counts what each rank *hands* to collectives in one
steady-state step, as our code issues them: an all-gather counts the rank's input piece, a
reduce-scatter its whole input, an all-reduce the tensor, an all-to-all what it sends,
send/recv what it sends. Shape: {dim: {kind: bytes, ..., "total": bytes}} with dims tp, dp
(FSDP / replicate over the flattened ep x dp x cp and dp x cp groups), pp, cp, ep and world
(the step's one stats all-reduce), kinds as in KINDS. Expert all-to-all sizes depend on the
routing; the count is the expected value under uniform routing (the dispatch forward and
the return's backward are exact; the return forward and the dispatch backward are expected).
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
`weight_pass_bytes`). bench/plan_accuracy.py measures it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config.schema import V_SCHEDULES, stage_layers
from .schedule_model import bubble_fraction as schedule_bubble
from .schedule_model import in_flight as schedule_in_flight
from .schedule_model import rank_stages, sends_per_microbatch, split_backward_states, stage_rank
from .shapes import flops_per_token, layer_of, param_shapes, tp_dim

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")
COMM_DIMS = ("tp", "dp", "pp", "cp", "ep", "world")
FP32 = 4


# -- parameters -------------------------------------------------------------------------


def _local_shape(recipe, name: str, shape: tuple[int, ...]) -> list[int]:
    """The shape of this parameter's tp / ep piece (before FSDP)."""
    p = recipe.parallelism
    shape = list(shape)
    dim = tp_dim(name)
    if p.tp_enabled and dim is not None:
        shape[dim] //= p.tp
    if p.ep_enabled and ".experts." in name:
        shape[0] //= p.ep
    return shape


def _unit_of(name: str) -> str:
    """The FSDP unit a parameter belongs to: a layer's experts, a layer, or the root."""
    layer = layer_of(name)
    if layer is None:
        return "root"
    return f"layer {layer} experts" if ".experts." in name else f"layer {layer}"


def virtual_layers(recipe) -> list[range]:
    """The decoder layers of every global pipeline stage (pp x stages_per_rank of them:
    balanced, or `pp_layers` with one stage per rank), as parallel/pipeline.split_stage cuts."""
    p, m = recipe.parallelism, recipe.model
    if not p.pp_enabled:
        return [range(m.num_hidden_layers)]
    return stage_layers(m.num_hidden_layers, p.pp_stages, p.pp_layers if p.stages_per_rank == 1 else None)


@dataclass(frozen=True)
class Part:
    """What one pipeline rank holds: its global stages (in its schedule's order), each
    stage's decoder layers, and whether it holds the first stage (the embedding) and the
    last (final norm, head, loss)."""

    rank: int
    stages: tuple[int, ...]
    stage_layers: tuple[range, ...]
    first: bool
    last: bool

    @property
    def layers(self) -> list[int]:
        return sorted(i for r in self.stage_layers for i in r)


def rank_parts(recipe) -> list[Part]:
    """One Part per pp rank (interleaved_1f1b: stages r, r + pp, ...; zbv, dualpipev: r and 2 pp - 1 - r)."""
    p, layers = recipe.parallelism, virtual_layers(recipe)
    parts = []
    for rank in range(p.pp):
        stages = tuple(rank_stages(p, rank))
        parts.append(Part(rank, stages, tuple(layers[s] for s in stages), 0 in stages, len(layers) - 1 in stages))
    return parts


def param_table(recipe) -> dict[str, dict]:
    """name -> {"stage", "pp_stage", "unit", "group", "shape"} for every parameter of the
    model: the pp rank that holds it ("stage", as plan's rows) and its global pipeline stage,
    its FSDP unit (the root: embedding, final norm, head; each layer; each layer's experts),
    that unit's FSDP group size and the parameter's tp / ep-local shape."""
    p, m = recipe.parallelism, recipe.model
    layers = virtual_layers(recipe)
    shard = (p.dp_shard if p.hsdp_enabled else p.dp) * p.cp  # hybrid: FSDP within dp_shard
    out = {}
    for name, shape in param_shapes(m).items():
        layer = layer_of(name)
        if layer is not None:
            stage = next(i for i, r in enumerate(layers) if layer in r)
        else:
            stage = 0 if name.startswith("model.embed_tokens") else len(layers) - 1
        unit = _unit_of(name)
        group = shard if unit.endswith("experts") else p.ep * shard
        row = {"stage": stage_rank(p, stage), "pp_stage": stage, "unit": unit, "group": group}
        out[name] = row | {"shape": _local_shape(recipe, name, shape)}
    return out


def stage_units(recipe) -> list[dict[str, dict]]:
    """Per pp rank: {unit: {"group": FSDP group size, "shapes": [tp/ep-local shapes]}}."""
    stages: list[dict[str, dict]] = [{} for _ in range(recipe.parallelism.pp)]
    for row in param_table(recipe).values():
        entry = stages[row["stage"]].setdefault(row["unit"], {"group": row["group"], "shapes": []})
        entry["shapes"].append(row["shape"])
    return stages


def shard_numel(shape: list[int], group: int) -> int:
    """Elements of FSDP2's dim-0 chunk on rank 0 (the largest; every rank's padded size)."""
    rows = -(-shape[0] // group) if shape else 1
    return rows * math.prod(shape[1:])


def unit_numels(recipe, units: dict[str, dict]) -> dict[str, tuple[int, int]]:
    """unit -> (elements rank 0 holds, elements FSDP gathers: padded, whole unit)."""
    fsdp = recipe.parallelism.fsdp_enabled
    out = {}
    for unit, u in units.items():
        n = u["group"] if fsdp else 1
        held = sum(shard_numel(s, n) for s in u["shapes"])
        out[unit] = (held, held * n)
    return out


# -- sizes every formula below uses ------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """Per-rank sizes of one microbatch on one rank."""

    tokens: int  # tokens of a microbatch on this rank: micro_batch_size * sequence_length / cp
    seq_tokens: int  # tokens of the residual stream (tokens / tp under sequence parallelism)
    kv_tokens: int  # tokens whose keys and values attention keeps (the whole sequence under cp)
    hidden: int
    q_width: int  # local query (and attention output) width: heads / tp * head_dim
    kv_width: int  # local key / value width
    inter: int  # local feed-forward width
    vocab: int  # local vocabulary (the head's logits)
    heads: int  # local query heads
    compute: int  # bytes of a matmul output: 2 under bf16 autocast, 4 in fp32


def sizes(recipe) -> Sizes:
    m, p, t = recipe.model, recipe.parallelism, recipe.training
    tokens = t.micro_batch_size * t.sequence_length // p.cp
    return Sizes(
        tokens=tokens,
        seq_tokens=tokens // p.tp if p.sequence_parallel else tokens,
        kv_tokens=t.micro_batch_size * t.sequence_length,
        hidden=m.hidden_size,
        q_width=m.num_attention_heads // p.tp * m.head_dim,
        kv_width=m.num_key_value_heads // p.tp * m.head_dim,
        inter=m.intermediate_size // p.tp,
        vocab=m.vocab_size // p.tp,
        heads=m.num_attention_heads // p.tp,
        compute=2 if t.dtype == "bfloat16" else FP32,
    )


def _moe_layers(recipe, layers: range) -> int:
    m = recipe.model
    if not m.num_local_experts:
        return 0
    return sum(1 for i in layers if m.moe_layers is None or i in m.moe_layers)


# -- activations -------------------------------------------------------------------------


def _linear_inputs(z: Sizes, n_linears: int) -> int:
    """What n linears reading one fp32 tensor keep: the tensor itself in fp32, or one bf16
    copy each under autocast."""
    return z.tokens * z.hidden * (FP32 if z.compute == FP32 else n_linears * z.compute)


def layer_activation_bytes(recipe, moe: bool) -> int:
    """Bytes autograd keeps for one decoder layer and one microbatch (no recompute)."""
    z, m = sizes(recipe), recipe.model
    norms = 2 * 2 * z.seq_tokens * z.hidden * FP32  # two RMSNorms: input and normalised output
    kv_tokens = z.kv_tokens if recipe.parallelism.cp_enabled else z.tokens
    attention = (
        _linear_inputs(z, 3)
        + 2 * z.tokens * z.q_width * z.compute  # rotated q, attention output (o_proj's input)
        + 2 * kv_tokens * z.kv_width * z.compute  # rotated (gathered) k and v
        + z.heads * z.tokens * FP32  # log-sum-exp
    )
    if not moe:
        return norms + attention + _linear_inputs(z, 2) + 4 * z.tokens * z.inter * z.compute
    routed = z.tokens * m.num_experts_per_tok
    inter = m.intermediate_size  # experts are not split over tp
    experts = (
        z.tokens * z.hidden * FP32  # router input
        + z.tokens * m.num_local_experts * FP32  # router probabilities
        + routed * z.hidden * (FP32 + z.compute)  # routed tokens, expert outputs
        + 4 * routed * inter * z.compute  # SwiGLU intermediates
    )
    shared = 4 * z.tokens * m.shared_expert_intermediate_size * z.compute
    return norms + attention + experts + shared


def selective_layer_bytes(recipe, moe: bool) -> int:
    """Bytes `recompute: selective` keeps for one decoder layer and one microbatch: the
    checkpoint's input (the fp32 residual stream) and the outputs of the ops
    models/layers.MATMUL_OPS names -- q/k/v/o projections, attention's output and
    log-sum-exp, the feed-forward's gate/up/down (an MoE layer's router, experts and shared
    expert) -- in the compute dtype; norms, RoPE, SiLU and products are recomputed."""
    z, m = sizes(recipe), recipe.model
    residual = z.seq_tokens * z.hidden * FP32
    attention = (
        z.tokens * (z.q_width + 2 * z.kv_width) * z.compute  # q, k, v projections
        + z.tokens * z.q_width * z.compute  # attention output
        + z.heads * z.tokens * FP32  # its log-sum-exp
        + z.tokens * z.hidden * z.compute  # o_proj
    )
    if not moe:
        return residual + attention + z.tokens * (2 * z.inter + z.hidden) * z.compute
    routed = z.tokens * m.num_experts_per_tok
    experts = z.tokens * m.num_local_experts * z.compute + routed * (2 * m.intermediate_size + z.hidden) * z.compute
    shared = z.tokens * (2 * m.shared_expert_intermediate_size + z.hidden) * z.compute
    return residual + attention + experts + (shared if m.shared_expert_intermediate_size else 0)


def layers_activation_bytes(recipe, layers) -> tuple[int, int]:
    """(bytes these decoder layers keep per microbatch, bytes alive once while one layer is
    recomputed in backward) under the recipe's recompute mode: none keeps every layer's
    activations; full keeps each layer's input and recomputes the rest; selective keeps the
    input and the matmul outputs and recomputes the rest."""
    p, z = recipe.parallelism, sizes(recipe)
    n_moe = _moe_layers(recipe, layers)
    kinds = [True] * n_moe + [False] * (len(layers) - n_moe)
    full = [layer_activation_bytes(recipe, moe) for moe in kinds]
    match p.recompute:
        case "full":
            return len(layers) * z.seq_tokens * z.hidden * FP32, max(full, default=0)
        case "selective":
            kept = [selective_layer_bytes(recipe, moe) for moe in kinds]
            return sum(kept), max((f - k for f, k in zip(full, kept)), default=0)
    return sum(full), 0


def virtual_stage_bytes(recipe, layers: range, first: bool, last: bool) -> tuple[int, int]:
    """(bytes one global stage keeps per microbatch, bytes alive once: recomputation's layer)."""
    p, z = recipe.parallelism, sizes(recipe)
    kept, once = layers_activation_bytes(recipe, layers)
    if first:
        kept += z.tokens * 8  # the embedding keeps its int64 indices
    if last:  # final norm, the head's input, log-probabilities and their gradient
        kept += 2 * z.seq_tokens * z.hidden * FP32 + _linear_inputs(z, 1) + 2 * z.tokens * z.vocab * FP32
    elif p.pp_enabled:  # the stage's output, which the schedule keeps for the microbatch's backward
        kept += z.seq_tokens * z.hidden * FP32
    return kept, once


def split_backward_bytes(recipe, layers) -> int:
    """What a microbatch-stage holds between its backward to the input (I) and to the weights
    (W) under zbv / dualpipev beyond what it kept before I: torch retains the stage's graph for
    W, with the gradients W reads (about the matmul outputs' size). Under recompute the layer
    recomputed for I does not outlive I (I reads every saved tensor it recomputed: measured,
    after I a stage holds these gradients and its input's gradient only); W recomputes
    again, `weight_pass_bytes`."""
    p, z = recipe.parallelism, sizes(recipe)
    if p.pp_engine not in V_SCHEDULES or not p.pp_enabled:
        return 0
    n_moe = _moe_layers(recipe, layers)
    kinds = [True] * n_moe + [False] * (len(layers) - n_moe)
    residual = z.seq_tokens * z.hidden * FP32
    return sum(selective_layer_bytes(recipe, moe) - residual for moe in kinds)


def _layer_param_tensors(recipe, layer: int) -> int:
    return sum(1 for name in param_shapes(recipe.model) if layer_of(name) == layer)


def weight_pass_bytes(recipe, layers, first: bool) -> int:
    """What one W (backward to the weights) of a stage holds at its peak under zbv / dualpipev
    with `recompute: full` (0 otherwise, and on the first stage: torch skips its I and its W
    is one whole backward, one recomputation per layer as in any backward).

    torch's stage_backward_weight calls autograd.grad once per parameter group (one per
    parameter tensor here: each weight's gradient starts at its own op), each call a new graph
    task, and torch.utils.checkpoint (non-reentrant) keeps recomputed tensors per graph task:
    every call re-runs the layer's forward and stores all its saved tensors, of which the call
    reads only its own op's. The rest stays referenced from the stage's graph, which W frees
    only after its last group (the layers of a stage chain one graph). A group that has run
    frees its op's saved input in every copy (the two norms' normalised outputs, the linears'
    inputs: R). So at the last group a layer with G parameter tensors and activations A holds
    G - 1 copies of A - R and one whole recomputation: G (A - R) + R; each earlier layer of
    the stage its G copies. Measured on one parity layer (tests/test_plan_accuracy.py):
    1,021,696 B above what I left (7.3 A), modelled 934,912; a 2-layer stage 1,854,976
    against 1,828,864. Selective recompute does not run under these schedules (torch fails in
    the first backward), so is not modelled."""
    p, z = recipe.parallelism, sizes(recipe)
    if first or p.recompute != "full" or p.pp_engine not in V_SCHEDULES or not p.pp_enabled:
        return 0
    copies, released = 0, [0]
    for i in layers:
        moe = _moe_layers(recipe, range(i, i + 1)) == 1
        # norms' normalised outputs, q/k/v's and o's inputs; gate/up's (an MoE's expert inputs: kept)
        r = 2 * z.seq_tokens * z.hidden * FP32 + _linear_inputs(z, 3) + z.tokens * z.q_width * z.compute
        r += 0 if moe else _linear_inputs(z, 2)
        copies += _layer_param_tensors(recipe, i) * (layer_activation_bytes(recipe, moe) - r)
        released.append(r)
    return copies + max(released)


def stage_activation_bytes(recipe, part: Part) -> tuple[int, int, int]:
    """(bytes one microbatch leaves on this pp rank through all its stages, bytes of the
    microbatch-stages in flight at the peak, bytes alive once per step: recomputation's one
    layer -- or a split W's copies, weight_pass_bytes -- and the pipeline's buffers). The
    peak is the largest of schedule_model's
    split_backward_states (k awaiting their backward, w between I and W; whole backwards:
    w = 0) at the largest non-last stage's bytes; with several stages per rank the last stage
    never has more than one microbatch in flight, counted once at its own size."""
    last_index = len(virtual_layers(recipe)) - 1
    kept, held, once = [], [], []
    for s, layers in zip(part.stages, part.stage_layers):
        k, o = virtual_stage_bytes(recipe, layers, s == 0, s == last_index)
        kept, held = kept + [k], held + [k + split_backward_bytes(recipe, layers)]
        once.append(max(o, weight_pass_bytes(recipe, layers, s == 0)))
    pairs = split_backward_states(recipe.parallelism, recipe.num_microbatches, part.rank)
    others = [i for i, s in enumerate(part.stages) if s != last_index]
    if part.last and others:
        ko, ho, i = max(kept[j] for j in others), max(held[j] for j in others), part.stages.index(last_index)
        peak = max(k * ko + w * ho for k, w in pairs) + max(kept[i] - ko, held[i] - ho)
    else:
        peak = max(k * max(kept) + w * max(held) for k, w in pairs)
    return sum(kept), peak, max(once) + pipeline_buffer_bytes(recipe, part)


def pipeline_buffer_bytes(recipe, part: Part) -> int:
    """What torch.distributed.pipelining holds for the whole step, whatever is in flight: for
    each of the rank's stages a receive buffer per microbatch for its input (all but the first
    stage) and for its output's gradient (all but the last), made once and kept (a V's
    same-rank hand-over keeps the tensor in that buffer alike); and with the last stage every
    microbatch's output (the logits), which the schedule keeps until the next step."""
    p, z, m = recipe.parallelism, sizes(recipe), recipe.num_microbatches
    if not p.pp_enabled:
        return 0
    residual, last = z.seq_tokens * z.hidden * FP32, p.pp_stages - 1
    held = sum(m * residual * ((s > 0) + (s < last)) for s in part.stages)
    if part.last:
        held += m * z.tokens * z.vocab * z.compute
    return held


def in_flight(recipe, pp_rank: int) -> int:
    """Microbatch-stages whose activations pp rank `pp_rank` holds at once, per schedule
    (schedule_model.in_flight: 1f1b min(m, pp - r), afab m, interleaved, zbv, dualpipev)."""
    return schedule_in_flight(recipe.parallelism, recipe.num_microbatches, pp_rank)


def bubble_fraction(recipe) -> float:
    """Idle share of a pipeline step, per schedule (schedule_model.bubble_fraction: 1f1b and
    afab (p - 1) / (m + p - 1), interleaved (p - 1) / (v m + p - 1), zbv, dualpipev)."""
    if not recipe.parallelism.pp_enabled:
        return 0.0
    return schedule_bubble(recipe.parallelism, recipe.num_microbatches)


# -- communication -----------------------------------------------------------------------


def _kinds(**bytes_by_kind: int) -> dict[str, int]:
    out = {k: int(bytes_by_kind.get(k, 0)) for k in KINDS}
    out["total"] = sum(out.values())
    return out


def _tp_layer(recipe, moe: bool) -> tuple[dict, dict]:
    """(forward, backward) tp bytes of one decoder layer and one microbatch."""
    p, z = recipe.parallelism, sizes(recipe)
    full_c, full_f = z.tokens * z.hidden * z.compute, z.tokens * z.hidden * FP32
    part_c, part_f = z.seq_tokens * z.hidden * z.compute, z.seq_tokens * z.hidden * FP32
    blocks = 1 if moe else 2  # attention, and the dense feed-forward (experts are replicated over tp)
    if not p.sequence_parallel:
        # Rowwise outputs are all-reduced forward; each colwise input's gradient backward.
        return {"all_reduce": blocks * full_c}, {"all_reduce": (3 + 2 * (not moe)) * full_f}
    fwd = {"all_gather": blocks * part_f, "reduce_scatter": blocks * full_c}
    bwd = {"all_gather": blocks * part_c, "reduce_scatter": blocks * full_f}
    if moe:  # the MoE gathers its input; backward gathers its (fp32) output's gradient
        fwd["all_gather"] += part_f
        bwd["all_gather"] += part_f
    return fwd, bwd


def replays_forward(recipe) -> bool:
    """Whether backward runs each layer's forward collectives again: under full recompute,
    and under selective too (its policy keeps only matmul outputs; the gathered inputs those
    matmuls' backward reads are recomputed, collectives included -- counted on tp2 sp x cp2)."""
    return recipe.parallelism.recompute in ("full", "selective")


def _tp_replay(recipe, fwd: dict, moe: bool) -> dict:
    """A layer's forward collectives that full recompute runs again in backward. Recompute
    stops once every tensor backward needs is back (torch's non-reentrant checkpoint), so a
    dense layer's last collective -- the feed-forward's output all-reduce (reduce-scatter
    under sequence parallelism), whose result backward never reads -- is not repeated. An
    MoE layer's last collective (its input's) is read by the experts: all are repeated."""
    if moe:
        return dict(fwd)
    z = sizes(recipe)
    last = "reduce_scatter" if recipe.parallelism.sequence_parallel else "all_reduce"
    return {**fwd, last: fwd[last] - z.tokens * z.hidden * z.compute}


def _add(total: dict, part: dict, times: int = 1) -> None:
    for kind, n in part.items():
        total[kind] = total.get(kind, 0) + n * times


def tp_bytes(recipe, part: Part) -> dict[str, int]:
    """Per step: DTensor collectives of the tp plan (parallel/tensor.py), per microbatch:
    each layer's (and, with recompute full or selective, its forward's again), the embedding's, the head's
    and loss_parallel's three all-reduces over the tokens (max, sum of exp, target logit);
    per step under sequence parallelism, the all-reduce of the norm weights' gradients
    (`match_grad_placements`), and with per-head q/k norms (Qwen3) theirs at either tp mode."""
    p, z = recipe.parallelism, sizes(recipe)
    if not p.tp_enabled:
        return _kinds()
    layers, per_micro = part.layers, {}
    n_moe = _moe_layers(recipe, layers)
    for moe, count in ((True, n_moe), (False, len(layers) - n_moe)):
        fwd, bwd = _tp_layer(recipe, moe)
        _add(per_micro, fwd, count)
        _add(per_micro, bwd, count)
        if replays_forward(recipe):
            _add(per_micro, _tp_replay(recipe, fwd, moe), count)
    full_f, part_f = z.tokens * z.hidden * FP32, z.seq_tokens * z.hidden * FP32
    if part.first:  # vocab-parallel embedding: its partial output is reduced
        _add(
            per_micro,
            {"reduce_scatter": full_f, "all_gather": part_f} if p.sequence_parallel else {"all_reduce": full_f},
        )
    if part.last:  # column-parallel head; loss_parallel's reductions
        _add(
            per_micro,
            {"all_gather": part_f, "reduce_scatter": full_f} if p.sequence_parallel else {"all_reduce": full_f},
        )
        _add(per_micro, {"all_reduce": 3 * z.tokens * FP32})
    per_step = {k: n * recipe.num_microbatches for k, n in per_micro.items()}
    if p.sequence_parallel:  # the norms' replicated weights: partial gradients summed once per step
        norms = 2 * len(layers) + part.last
        _add(per_step, {"all_reduce": norms * z.hidden * FP32})
    if recipe.model.qk_norm:  # per-head q/k norms see this rank's heads: their gradients summed too
        _add(per_step, {"all_reduce": 2 * len(layers) * recipe.model.head_dim * FP32})
    return _kinds(**per_step)


def dp_bytes(recipe, units: dict[str, dict]) -> dict[str, int]:
    """Per step. FSDP2: every unit all-gathers its shard for each forward and (resharded
    after forward) each backward -- twice per microbatch; under pp parameters stay gathered
    for the whole step: once -- and reduce-scatters its whole gradient once; under
    dp_mode hybrid within ep x dp_shard x cp, then all-reduces the shard across the
    dp_replicate replicas. Replicate: one all-reduce of the gradients (dense over
    ep x dp x cp, experts over dp x cp)."""
    p = recipe.parallelism
    numels = unit_numels(recipe, units)
    if p.fsdp_enabled:
        gathers = 1 if p.pp_enabled else 2 * recipe.num_microbatches
        sharded = [numels[name] for name, u in units.items() if u["group"] > 1]
        replicas = p.dp_replicate if p.hsdp_enabled else 1  # HSDP all-reduces the shards across replicas
        return _kinds(
            all_gather=gathers * FP32 * sum(held for held, _ in sharded),
            reduce_scatter=FP32 * sum(whole for _, whole in sharded),
            all_reduce=FP32 * sum(held for held, _ in sharded) * (replicas > 1),
        )
    if p.replicate_enabled:
        return _kinds(all_reduce=FP32 * sum(numels[name][0] for name, u in units.items() if u["group"] > 1))
    return _kinds()


def pp_bytes(recipe, part: Part) -> dict[str, int]:
    """Per step: each microbatch's fp32 residual stream sent from each of the rank's stages
    to the next stage and its gradient to the previous one, where that stage is on another
    rank (schedule_model.sends_per_microbatch)."""
    z = sizes(recipe)
    sends = sends_per_microbatch(recipe.parallelism, part.rank)
    return _kinds(send_recv=sends * recipe.num_microbatches * z.seq_tokens * z.hidden * FP32)


def cp_bytes(recipe, layers: list[int], backend: str) -> dict[str, int]:
    """Per step: each attention all-gathers its k and v (again under recompute); backward
    reduce-scatters their gradients (gloo: all-reduces them). MoE layers all-reduce their
    routing sums (2E + 1 floats) forward and backward."""
    p, z, m = recipe.parallelism, sizes(recipe), recipe.model
    if not p.cp_enabled:
        return _kinds()
    forwards = 2 if replays_forward(recipe) else 1
    kv = 2 * z.tokens * z.kv_width * z.compute
    grads = 2 * z.kv_tokens * z.kv_width * z.compute
    stats = (2 * m.num_local_experts + 1) * FP32 * _moe_layers(recipe, layers) * (forwards + 1)
    bwd_kind = "reduce_scatter" if backend == "nccl" else "all_reduce"
    per_micro = {"all_gather": forwards * kv * len(layers), bwd_kind: grads * len(layers)}
    per_micro["all_reduce"] = per_micro.get("all_reduce", 0) + stats
    return _kinds(**{k: n * recipe.num_microbatches for k, n in per_micro.items()})


def ep_bytes(recipe, layers: list[int]) -> dict[str, int]:
    """Per step, expected under uniform routing: per MoE layer and forward the int64 token
    counts (E), the routed tokens out (fp32) and back (compute dtype); backward the same
    two ways for the gradients."""
    p, z, m = recipe.parallelism, sizes(recipe), recipe.model
    if not p.ep_enabled:
        return _kinds()
    forwards = 2 if replays_forward(recipe) else 1
    rows = z.tokens * m.num_experts_per_tok * z.hidden
    fwd = m.num_local_experts * 8 + rows * (FP32 + z.compute)
    bwd = rows * (z.compute + FP32)
    return _kinds(all_to_all=(forwards * fwd + bwd) * _moe_layers(recipe, layers) * recipe.num_microbatches)


def world_bytes(recipe) -> dict[str, int]:
    """The step's one world all-reduce: loss, squared grad norm, aux loss, tokens per expert."""
    return _kinds(all_reduce=(3 + recipe.model.num_local_experts) * FP32)


def comm_bytes(recipe, backend: str | None = None) -> list[dict[str, dict[str, int]]]:
    """Per pp rank: {dim: {kind: bytes, "total": bytes}} each rank with that pp coordinate
    hands to collectives in one steady-state step. backend: "gloo" or "nccl" (default: from
    training.device; cp's backward differs). This is the count tests compare with
    tests/dist_scripts/comm_bytes.py."""
    backend = backend or ("gloo" if recipe.training.device == "cpu" else "nccl")
    out = []
    for part, units in zip(rank_parts(recipe), stage_units(recipe)):
        out.append(
            {
                "tp": tp_bytes(recipe, part),
                "dp": dp_bytes(recipe, units),
                "pp": pp_bytes(recipe, part),
                "cp": cp_bytes(recipe, part.layers, backend),
                "ep": ep_bytes(recipe, part.layers),
                "world": world_bytes(recipe),
            }
        )
    return out


# -- memory and the whole estimate -------------------------------------------------------


def _fsdp_working_bytes(recipe, numels: dict[str, tuple[int, int]]) -> int:
    """Gathered parameters and unsharded gradients FSDP holds at the peak (the backward).
    pp: the whole stage stays gathered for the step, with its unsharded gradients. Otherwise
    the root (gathered through the whole backward) and two blocks (the current one and the
    prefetched one); gradients of every unit accumulate unsharded over the microbatches
    before the last, else only the root's and the current block's."""
    p = recipe.parallelism
    if not p.fsdp_enabled:
        return 0
    whole = {name: gathered - held for name, (held, gathered) in numels.items()}
    if p.pp_enabled:
        return 2 * FP32 * sum(whole.values())
    root = whole.pop("root", 0)
    blocks = sorted(whole.values(), reverse=True)
    grads = sum(blocks) if recipe.num_microbatches > 1 else sum(blocks[:1])
    return FP32 * (2 * root + sum(blocks[:2]) + grads)


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
        "optimizer_bytes": 2 * params * FP32 + tensors * FP32,  # exp_avg, exp_avg_sq; a step scalar each
        "activation_bytes_per_microbatch": per_micro,
        "microbatches_in_flight": in_flight(recipe, part.rank),
        "activation_bytes": in_flight_bytes + once,
    }
    row["peak_bytes"] = (
        row["param_bytes"]
        + row["grad_bytes"]
        + row["optimizer_bytes"]
        + row["activation_bytes"]
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


def estimate(recipe, peak_tflops: float | None = None, mfu: float = 0.4, backend: str | None = None) -> dict:
    """The whole estimate (the JSON under `plan --json`'s key "estimate")."""
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
