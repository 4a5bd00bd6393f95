"""The estimate's activation memory: bytes a layer keeps for its backward (none, full and
selective recompute), a stage's peak with the schedule's microbatches in flight, the split
backward's extra under zbv / dualpipev, the pipeline's buffers and bubble. Pure Python."""

from __future__ import annotations

from ..config.parallelism import window_tails
from ..config.schema import V_SCHEDULES
from .params import FP32, Part, Sizes, param_table, sizes, virtual_layers
from .schedule_model import bubble_fraction as schedule_bubble
from .schedule_model import in_flight as schedule_in_flight
from .schedule_model import split_backward_states
from .shapes import layer_of, param_shapes


def _moe_layers(recipe, layers: range) -> int:
    m = recipe.model
    if not m.num_local_experts:
        return 0
    return sum(1 for i in layers if m.is_moe_layer(i))


# -- activations -------------------------------------------------------------------------


def _linear_inputs(z: Sizes, n_linears: int) -> int:
    """What n linears reading one fp32 tensor keep: the tensor itself in fp32, or one bf16
    copy each under autocast."""
    return z.tokens * z.hidden * (FP32 if z.compute == FP32 else n_linears * z.compute)


def _latent_bytes(recipe, z: Sizes) -> int:
    """Multi-head latent attention's low-rank path: the q and kv latents before and after
    their norms, and kv_b_proj's per-head output (the RoPE-free keys and the values)."""
    m = recipe.model
    if not m.mla:
        return 0
    latents = 2 * ((m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_rope_head_dim)
    return z.tokens * (latents + z.heads * (m.qk_nope_head_dim + m.v_head_dim)) * z.compute


def weight_copy_bytes(recipe, rank: int) -> int:
    """bf16 autocast (a run without FSDP) casts every weight a linear reads to bf16 once per
    step and keeps the copy for the step (torch's autocast weight cache; the linear's backward
    reads it): 2 bytes per element of this pp rank's 2-D linear weights -- the blocks', the
    routers', the head's (a tied head's, the embedding's), not the embedding's own nor the
    stacked experts'. torchao's Float8Linear (training.float8) saves its fp32 master weight
    itself for backward and casts it to float8 again there (measured with saved-tensor hooks:
    a converted linear keeps its bf16 input and no weight copy), so its weights add none.
    Measured at world 1 on the parity model (bench/accuracy_rank.py): bf16 keeps 292,984
    bytes more than float8 tensorwise, whose converted block weights are 147,456 elements."""
    t, m = recipe.training, recipe.model
    if t.dtype != "bfloat16" or recipe.parallelism.fsdp_enabled:
        return 0
    total = 0
    for name, row in param_table(recipe).items():
        shape, linear = row["shape"], name.endswith(".weight") and len(row["shape"]) == 2
        if row["stage"] != rank or not linear or row.get("float8"):
            continue
        if name == "model.embed_tokens.weight" and not (m.tie_word_embeddings and not recipe.parallelism.pp_enabled):
            continue  # the embedding's lookup casts nothing; one process's tied head reads it as its weight
        total += 2 * shape[0] * shape[1]
    return total


def moe_tokens(recipe) -> int:
    """Tokens of a microbatch one rank routes through its MoE layers: its share over tp
    (parallel/expert.py; ceil-sized pieces)."""
    return -(-sizes(recipe).tokens // recipe.parallelism.tp)


def kept_kv_bytes(recipe, layer: int | None = None) -> int:
    """The keys and values a layer's attention keeps for backward, one microbatch: this rank's,
    or under cp the gathered whole sequence's; under cp with a sliding window that fits in a
    zigzag chunk (parallel/context.window_attention), each chunk's own and the window - 1 before
    it."""
    z, p, t = sizes(recipe), recipe.parallelism, recipe.training
    if not p.cp_enabled:
        return z.tokens * z.kv_pair * z.compute
    tails = None if layer is None else window_tails(recipe.model.layer_window(layer), t.sequence_length, p.cp)
    if not tails:
        return z.kv_tokens * z.kv_pair * z.compute
    return t.micro_batch_size * (z.tokens // t.micro_batch_size + 2 * tails) * z.kv_pair * z.compute


def layer_activation_bytes(recipe, moe: bool, layer: int | None = None) -> int:
    """Bytes autograd keeps for one decoder layer and one microbatch (no recompute); `layer`:
    its index (a sliding window's keys under cp, `kept_kv_bytes`)."""
    z, m = sizes(recipe), recipe.model
    norms = 2 * 2 * z.seq_tokens * z.hidden * FP32  # two RMSNorms: input and normalised output
    attention = (
        _linear_inputs(z, 3)
        + 2 * z.tokens * z.q_width * z.compute  # rotated q, attention output (o_proj's input)
        + kept_kv_bytes(recipe, layer)  # rotated (gathered) k and v
        + z.heads * z.tokens * FP32  # log-sum-exp
        + _latent_bytes(recipe, z)
    )
    if not moe:
        return norms + attention + _linear_inputs(z, 2) + 4 * z.tokens * z.inter * z.compute
    tokens = moe_tokens(recipe)
    routed = tokens * m.num_experts_per_tok
    inter = m.expert_intermediate_size  # experts are not split over tp
    experts = (
        tokens * z.hidden * FP32  # router input
        + tokens * m.num_local_experts * FP32  # router probabilities
        + routed * z.hidden * (FP32 + z.compute)  # routed tokens, expert outputs
        + 4 * routed * inter * z.compute  # SwiGLU intermediates
    )
    shared = 4 * tokens * m.shared_intermediate_size * z.compute
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
        z.tokens * (z.q_width + z.kv_pair) * z.compute  # q, k, v projections
        + z.tokens * z.q_width * z.compute  # attention output
        + z.heads * z.tokens * FP32  # its log-sum-exp
        + z.tokens * z.hidden * z.compute  # o_proj
    )
    if not moe:
        return residual + attention + z.tokens * (2 * z.inter + z.hidden) * z.compute
    tokens = moe_tokens(recipe)
    routed = tokens * m.num_experts_per_tok
    experts = (
        tokens * m.num_local_experts * z.compute + routed * (2 * m.expert_intermediate_size + z.hidden) * z.compute
    )
    shared = tokens * (2 * m.shared_intermediate_size + z.hidden) * z.compute
    return residual + attention + experts + (shared if m.shared_intermediate_size else 0)


def layers_activation_bytes(recipe, layers) -> tuple[int, int]:
    """(bytes these decoder layers keep per microbatch, bytes alive once while one layer is
    recomputed in backward) under the recipe's recompute mode: none keeps every layer's
    activations; full keeps each layer's input and recomputes the rest; selective keeps the
    input and the matmul outputs and recomputes the rest."""
    p, z = recipe.parallelism, sizes(recipe)
    kinds = [_moe_layers(recipe, range(i, i + 1)) == 1 for i in layers]
    full = [layer_activation_bytes(recipe, moe, i) for moe, i in zip(kinds, layers)]
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
    if last:  # final norm, the head's input, log-probabilities and their gradient (and each MTP depth's)
        heads = 1 + recipe.model.num_nextn_predict_layers
        kept += heads * (2 * z.seq_tokens * z.hidden * FP32 + _linear_inputs(z, 1) + 2 * z.tokens * z.vocab * FP32)
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
    the stage its G copies. Measured on one parity layer (tests/plan/test_plan_accuracy.py):
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
        copies += _layer_param_tensors(recipe, i) * (layer_activation_bytes(recipe, moe, i) - r)
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
    if part.last:  # the logits of the main head and of each MTP depth
        held += m * z.tokens * z.vocab * z.compute * (1 + recipe.model.num_nextn_predict_layers)
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
