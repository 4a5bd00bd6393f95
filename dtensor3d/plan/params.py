"""The estimate's first part: each rank's parameters, as the code cuts them (tp by the plan in
parallel/tensor.py, experts over ep, FSDP2's dim-0 chunks), the pipeline parts a rank holds, and
the sizes the activation and communication models read. Pure Python (see plan/estimate.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config.low_precision import float8_all_gather, float8_weight
from ..config.schema import V_SCHEDULES, stage_layers
from .schedule_model import rank_stages, stage_rank
from .shapes import layer_of, param_shapes, tp_dim

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")
COMM_DIMS = ("tp", "dp", "pp", "cp", "ep", "world")
FP32 = 4


# -- parameters -------------------------------------------------------------------------


def _local_shape(recipe, name: str, shape: tuple[int, ...]) -> list[int]:
    """The shape of this parameter's tp / ep piece (before FSDP)."""
    p = recipe.parallelism
    shape = list(shape)
    dim = tp_dim(name, recipe.model)
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
    # the MTP blocks (models/mtp.py: layers N..N+D-1, one more decoder block each) on the last stage
    layers[-1] = range(layers[-1].start, layers[-1].stop + recipe.model.num_nextn_predict_layers)
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
        if layer is not None:  # an MTP module's (past the last layer): the last stage's
            stage = next((i for i, r in enumerate(layers) if layer in r), len(layers) - 1)
        else:
            stage = 0 if name.startswith("model.embed_tokens") else len(layers) - 1
        unit = _unit_of(name)
        group = shard if unit.endswith("experts") else p.ep * shard
        row = {"stage": stage_rank(p, stage), "pp_stage": stage, "unit": unit, "group": group}
        row["grad"] = not name.endswith("e_score_correction_bias")  # the router's bias: moved, not trained
        row["float8"] = recipe.training.float8 is not None and float8_weight(name, tuple(shape))
        out[name] = row | {"shape": _local_shape(recipe, name, shape)}
    if (m.tie_word_embeddings or m.num_nextn_predict_layers) and p.pp_enabled:
        # the last stage's copy of the embedding (parallel/tied.py): the tied head's, or MTP's
        # (model.mtp_embed_tokens: the tied head's parameter where both, except under a V
        # schedule, where the tied head is a third copy: parallel/tied.py's `copies`)
        copy = out["model.embed_tokens.weight"] | {"stage": stage_rank(p, len(layers) - 1), "pp_stage": len(layers) - 1}
        out["model.mtp_embed_tokens.weight" if m.num_nextn_predict_layers else "lm_head.weight"] = copy
        if m.tie_word_embeddings and m.num_nextn_predict_layers and p.pp_engine in V_SCHEDULES:
            out["lm_head.weight"] = dict(copy)
    return out


def stage_units(recipe) -> list[dict[str, dict]]:
    """Per pp rank: {unit: {"group": FSDP group size, "shapes": [tp/ep-local shapes]}}."""
    stages: list[dict[str, dict]] = [{} for _ in range(recipe.parallelism.pp)]
    for row in param_table(recipe).values():
        entry = stages[row["stage"]].setdefault(
            row["unit"], {"group": row["group"], "shapes": [], "no_grad": [], "float8": []}
        )
        entry["shapes"].append(row["shape"])
        if row.get("float8"):
            entry["float8"].append(row["shape"])
        if not row["grad"]:
            entry["no_grad"].append(row["shape"])
    return stages


def shard_numel(shape: list[int], group: int) -> int:
    """Elements of FSDP2's dim-0 chunk on rank 0 (the largest; every rank's padded size)."""
    rows = -(-shape[0] // group) if shape else 1
    return rows * math.prod(shape[1:])


def gather_bytes(recipe, units: dict[str, dict]) -> dict[str, int]:
    """unit -> bytes of this rank's input to one FSDP2 all-gather of it (rank 0's padded shard):
    the compute dtype's width, 1 byte for a weight FSDP gathers in float8 (training.float8
    tensorwise's fsdp_all_gather: half of bf16's)."""
    fp8 = float8_all_gather(recipe.training, recipe.parallelism)
    out = {}
    for unit, u in units.items():
        n = u["group"] if recipe.parallelism.fsdp_enabled else 1
        low = sum(shard_numel(s, n) for s in u.get("float8", ())) if fp8 else 0
        out[unit] = sizes(recipe).compute * (sum(shard_numel(s, n) for s in u["shapes"]) - low) + low
    return out


def unit_numels(recipe, units: dict[str, dict], grads: bool = False) -> dict[str, tuple[int, int]]:
    """unit -> (elements rank 0 holds, elements FSDP gathers: padded, whole unit); `grads`:
    of the parameters with a gradient only (what FSDP reduce-scatters)."""
    fsdp = recipe.parallelism.fsdp_enabled
    out = {}
    for unit, u in units.items():
        n = u["group"] if fsdp else 1
        held = sum(shard_numel(s, n) for s in u["shapes"])
        if grads:
            held -= sum(shard_numel(s, n) for s in u.get("no_grad", ()))
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
    kv_width: int  # local key / value width (multi-head latent attention: their mean)
    kv_pair: int  # local key plus value width (what context parallelism gathers per token)
    inter: int  # local feed-forward width
    vocab: int  # local vocabulary (the head's logits)
    heads: int  # local query heads
    compute: int  # bytes of a matmul output: 2 under bf16 autocast, 4 in fp32
    # Bytes of any other activation (the residual stream, a norm's output, their gradients):
    # 4 in fp32 and under bf16 autocast (it casts only the matmuls' inputs); 2 where bf16
    # training gathers bf16 parameters (FSDP2's MixedPrecisionPolicy, no autocast: every
    # activation from the embedding on is bf16).
    act: int
    # Bytes of a router score (the MoE routing sums tp / cp all-reduce): the router computes
    # F.linear(x.float(), w.float()), which bf16 autocast still runs in bf16, and its softmax
    # stays bf16 on CPU (CUDA's autocast runs softmax in fp32; sigmoid follows its input): 2
    # under autocast unless softmax on CUDA, else 4.
    router: int


def sizes(recipe) -> Sizes:
    m, p, t = recipe.model, recipe.parallelism, recipe.training
    autocast = t.dtype == "bfloat16" and not p.fsdp_enabled
    tokens = t.micro_batch_size * t.sequence_length // p.cp
    heads = m.num_attention_heads // p.tp
    q_width, kv_pair = heads * m.head_dim, 2 * m.num_key_value_heads // p.tp * m.head_dim
    if m.mla:  # every local head has a key of qk width and a value of v_head_dim
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q_width, kv_pair = heads * qk, heads * (qk + m.v_head_dim)
    return Sizes(
        tokens=tokens,
        seq_tokens=tokens // p.tp if p.sequence_parallel else tokens,
        kv_tokens=t.micro_batch_size * t.sequence_length,
        hidden=m.hidden_size,
        q_width=q_width,
        kv_width=kv_pair // 2,
        kv_pair=kv_pair,
        inter=m.intermediate_size // p.tp,
        vocab=m.padded_vocab_size // p.tp,
        heads=heads,
        compute=2 if t.dtype == "bfloat16" else FP32,
        act=2 if t.dtype == "bfloat16" and p.fsdp_enabled else FP32,
        router=2 if autocast and (t.device == "cpu" or m.scoring_func == "sigmoid") else FP32,
    )
