"""Tensor parallelism as data: a table from module path to a DTensor ParallelStyle.

`tp_plan(recipe)` returns the tables; `apply_tp` hands them to PyTorch's
`parallelize_module`. Under ALL_REDUCE the residual stream is replicated over tp, each
block ends in an all-reduce and its input's gradient is all-reduced once (`_block_inputs`);
under REDUCE_SCATTER (sequence parallelism) the residual stream and the norms are sharded on
the sequence (the norms computed on plain tensors, `SequenceShardNorm`) and each block gathers
its input and reduce-scatters its output. The head is
column-parallel and its logits stay sharded on the vocabulary for `loss_parallel`
cross-entropy.

Multi-head latent attention (DeepSeek-V3, models/mla.py) is sharded by heads too: q_b_proj
(or q_proj) and kv_b_proj column-parallel -- their rows are per-head blocks -- and o_proj
row-parallel. The low-rank down projections q_a_proj and kv_a_proj_with_mqa and their norms
stay replicated: each norm is over its whole latent, so a column-split down projection would
need an all-gather of the latent in every layer forward (and its gradient's reduction
backward) to save a small matmul (the latent is 1536 + 576 wide against 7168 x 128 heads
in the up projections: about 5% of the layer's attention FLOPs for DeepSeek-V3), as
Megatron and transformers' plan keep them. Under sequence parallelism the attention takes its
gathered input as a plain tensor for them, so each column-parallel up projection all-reduces
its input's gradient (together narrower than the hidden state the gather's backward would
reduce-scatter) and the gather's backward only slices. One fix-up: the last qk_rope_head_dim columns
of kv_a_proj_with_mqa's output are the RoPE key every head shares, so a rank's gradient of
them covers only its heads; `SharedKeyGradient` sums it over tp (an identity forward and an
all-reduce backward: Megatron's "f" operator), at the one place where heads meet again.

Biases go with their linears (a column-parallel bias is sharded like the rows, a row-parallel
one replicated and added once after the reduction: DTensor's own rules). Per-head q/k norms
(Qwen3) see this rank's heads: their weight is a replicated DTensor and their input is marked
sharded on the heads dim, so the weight's gradient is summed over tp by DTensor.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import local_map
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from ..models.layers import rms_norm
from .async_tp import apply_async_tp
from .float8 import float8_styles


class SharedKeyGradient(ParallelStyle):
    """For a replicated linear whose last `width` output columns feed every head (MLA's
    kv_a_proj_with_mqa: the shared RoPE key): those columns pass unchanged forward, and their
    gradient -- on each rank the sum over its own heads only -- is all-reduced over tp in
    backward, so the weight's and the input's gradients are the whole model's."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def hook(_module, _inputs, out):
            rest, shared = out.split([out.shape[-1] - self.width, self.width], dim=-1)
            shared = DTensor.from_local(shared, device_mesh, (Replicate(),), run_check=False)
            return torch.cat([rest, shared.to_local(grad_placements=(Partial(),))], dim=-1)

        module.register_forward_hook(hook)
        return module


class SequenceShardNorm(ParallelStyle):
    """Sequence parallelism for an RMSNorm (models/layers.py), computed on this rank's
    sequence shard as plain tensors (`local_map`): the same math as torch's `SequenceParallel`
    without a DTensor dispatch per op (a tp 2 step 1.03-1.08x faster, BENCHMARKS.md). The weight
    is a replicated DTensor; its gradient, each rank's over its own tokens, comes back partial
    over tp and is summed once per step with the other gradients (`match_grad_placements`).
    The output is a DTensor sharded on the sequence, as `SequenceParallel` gives it."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        weight = distribute_tensor(module.weight.data, device_mesh, (Replicate(),))
        module.register_parameter("weight", nn.Parameter(weight, requires_grad=module.weight.requires_grad))
        norm = local_map(
            rms_norm,
            out_placements=[Shard(1)],
            in_placements=([Shard(1)], [Replicate()], None),
            in_grad_placements=([Shard(1)], [Partial()], None),
            device_mesh=device_mesh,
        )
        module.forward = lambda x: norm(x, module.weight, module.eps)
        return module


class _SumOverTp(torch.autograd.Function):
    """all-reduce forward, all-reduce backward: a sum every tp rank uses on its own slice, so
    each rank's share of the gradient is the sum of every rank's (Megatron's f and g in one)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return funcol.wait_tensor(funcol.all_reduce(t, "sum", group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None


class WholeProjectionNorm(ParallelStyle):
    """An RMSNorm over a whole column-parallel projection, not per head (OLMo 2's q/k norms):
    each rank holds its heads' columns, so the weight is sharded like them (Shard(0)) and the
    mean of squares is this rank's sum of squares all-reduced over tp ([b, s, 1] fp32, forward
    and backward: `_SumOverTp`) over the whole width. The model's own `rms_norm` does the rest
    on plain tensors. (DTensor's rules get the same numbers but reduce-scatter the gradient
    at the projection's width, not the sum's.)"""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        width, group = module.weight.shape[0], device_mesh.get_group()
        weight = distribute_tensor(module.weight.data, device_mesh, (Shard(0),))
        module.register_parameter("weight", nn.Parameter(weight, requires_grad=module.weight.requires_grad))

        def mean_sq(xf: torch.Tensor) -> torch.Tensor:
            return _SumOverTp.apply(xf.pow(2).sum(-1, keepdim=True), group) / width

        module.forward = lambda x: rms_norm(x, module.weight.to_local(), module.eps, module.offset, mean_sq)
        return module


class ShardParameter(ParallelStyle):
    """A plan row for a parameter of a module, not a module (the row's path ends in its name):
    sharded on `dim` over tp, each rank keeping its slice. gpt-oss's per-head attention sinks
    (`self_attn.sinks` [heads]) are split as q_proj's rows are, so each rank holds its heads'
    sinks; the model takes the local slice (`to_local`) and the gradient stays sharded."""

    def __init__(self, dim: int = 0):
        super().__init__()
        self.dim = dim

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        raise TypeError("ShardParameter is applied by apply_tp to the parameter its row names")

    def shard(self, parent: nn.Module, name: str, device_mesh) -> None:
        param = getattr(parent, name)
        sharded = distribute_tensor(param.data, device_mesh, (Shard(self.dim),), src_data_rank=None)
        parent.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def _shard_parameters(block: nn.Module, layer: dict, tp_mesh) -> None:
    """The plan's ShardParameter rows (paths naming a parameter) that `block` has."""
    for path, style in layer.items():
        parent, _, name = path.rpartition(".")
        if (
            isinstance(style, ShardParameter)
            and _has_module(block, parent)
            and hasattr(block.get_submodule(parent), name)
        ):
            style.shard(block.get_submodule(parent), name, tp_mesh)


def _mla_rows(shared_key: int) -> dict:
    """Multi-head latent attention's own rows (q_proj and o_proj are Llama's): the per-head up
    projections column-parallel, the shared RoPE key's gradient summed; the down projections
    stay whole. `shared_key`: qk_rope_head_dim (0: grouped-query attention, no rows)."""
    if not shared_key:
        return {}
    return {
        "self_attn.q_b_proj": ColwiseParallel(),
        "self_attn.kv_b_proj": ColwiseParallel(),
        "self_attn.kv_a_proj_with_mqa": SharedKeyGradient(shared_key),
    }


def tp_plan(
    sequence_parallel: bool, moe: bool = False, overlapped: bool = False, shared_key: int = 0, whole_norm: bool = False
) -> tuple[dict, dict]:
    """(plan for the model's outer modules, plan for a decoder layer). A mixture-of-experts
    layer's feed-forward is replicated over tp and each tp rank routes a disjoint share of
    the tokens (parallel/expert.py): under sequence parallelism its sequence shard, as a
    local tensor. `overlapped` (tp_linear_async_communication's chunked path): the
    projections parallel/async_tp.py shards itself, and their input gathers, are left out. `_mla_rows`: MLA's.
    `whole_norm`: the q/k norms span the whole projection (OLMo 2): `WholeProjectionNorm`."""
    seq = Shard(1) if sequence_parallel else Replicate()
    per_head = functools.partial(SequenceParallel, sequence_dim=1, use_local_output=True)
    head_norm = WholeProjectionNorm if whole_norm else per_head
    outer = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "model.mtp_embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),  # pp: MTP's copy
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    layer = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=seq),
        "self_attn.sinks": ShardParameter(0),  # gpt-oss: a parameter [heads], split with them
        # [b, heads, s, d]: this rank's heads (dim 1); a module a model lacks is skipped
        "self_attn.q_norm": head_norm(),
        "self_attn.k_norm": head_norm(),
    } | _mla_rows(shared_key)
    if not moe:
        layer.update(
            {
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=seq),
            }
        )
    if sequence_parallel:
        outer["model.norm"] = SequenceShardNorm()
    layer |= _block_inputs(sequence_parallel, moe, shared_key)
    return outer, _without_overlapped(layer, sequence_parallel) if overlapped else layer


class TokenwiseLinear(ParallelStyle):
    """Sequence parallelism for a linear that acts on each token alone (an MTP module's eh_proj):
    computed on this rank's sequence shard as plain tensors (`local_map`, as `SequenceShardNorm`),
    the weight a replicated DTensor whose gradient, each rank's over its own tokens, comes back
    partial over tp and is summed once per step with the others (`match_grad_placements`). The
    output is this rank's shard as a plain tensor, as a decoder block takes its input."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        weight = distribute_tensor(module.weight.data, device_mesh, (Replicate(),))
        module.register_parameter("weight", nn.Parameter(weight, requires_grad=module.weight.requires_grad))
        linear = local_map(
            torch.nn.functional.linear,
            out_placements=[Shard(1)],
            in_placements=([Shard(1)], [Replicate()]),
            in_grad_placements=([Shard(1)], [Partial()]),
            device_mesh=device_mesh,
        )
        module.forward = lambda x: linear(x, module.weight).to_local()
        return module


def mtp_rows(sequence_parallel: bool) -> dict:
    """An MTP module's own rows beside its decoder block's (models/mtp.py: enorm, hnorm, eh_proj,
    shared_head.norm). ALL_REDUCE: none -- the residual stream is replicated, so they stay whole,
    plain modules computed alike on every tp rank (eh_proj, 2 x hidden -> hidden, once per
    token: no communication; the block's input gradient is all-reduced by its input style, so
    their gradients are the whole model's). Sequence parallelism: the norms on the sequence
    shards and eh_proj token-wise on them, its output this rank's shard of the block's input."""
    if not sequence_parallel:
        return {}
    norms = {path: SequenceShardNorm() for path in ("enorm", "hnorm", "shared_head.norm")}
    return norms | {"eh_proj": TokenwiseLinear()}


def _block_inputs(sequence_parallel: bool, moe: bool, shared_key: int) -> dict:
    """How each block (attention, feed-forward) takes its input, and under sequence
    parallelism the norms before them. ALL_REDUCE: q/k/v (gate/up) take the replicated input
    as one DTensor, so their input gradients, each partial over tp, are summed as DTensors and
    all-reduced once per block, not once each (MLA's attention keeps its plain input: its
    replicated down projections read it). Sequence parallelism: the norms run on the sequence
    shards and each block gathers its input (MLA: as a plain tensor, module docstring); an MoE
    feed-forward routes this rank's shard, no gather (parallel/expert.py)."""
    if not sequence_parallel:
        whole = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
        return ({} if shared_key else {"self_attn": whole}) | ({} if moe else {"mlp": whole})
    gather = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=bool(shared_key)
    )
    inputs = {"self_attn": gather, "input_layernorm": SequenceShardNorm()}
    inputs["post_attention_layernorm"] = SequenceShardNorm()
    if moe:
        inputs["block_sparse_moe"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
    else:
        inputs["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return inputs


def _without_overlapped(layer: dict, sequence_parallel: bool) -> dict:
    """The layer plan less what parallel/async_tp.py shards itself: the column projections and
    their parents' input styles, and under sequence parallelism the row projections too."""
    taken = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "self_attn", "mlp"}
    taken |= {"o_proj", "down_proj"} if sequence_parallel else set()
    return {path: style for path, style in layer.items() if path.split(".")[-1] not in taken}


def tp_overlap(parallelism, device_type: str, compiled: bool) -> str | None:
    """How tp_linear_async_communication overlaps tp communication with the matmuls:
    "micro_pipeline" on CUDA with training.compile under sequence parallelism (torch
    inductor's async TP rewrites the plan's all-gather + matmul and matmul + reduce-scatter
    over symmetric memory); "chunked" otherwise (parallel/async_tp.py's Functions, eager or
    compiled, any device); None with the key off or tp 1."""
    if not (parallelism.tp_linear_async_communication and parallelism.tp_enabled):
        return None
    if device_type == "cuda" and compiled and parallelism.sequence_parallel:
        return "micro_pipeline"
    return "chunked"


def enable_micro_pipeline(tp_mesh) -> None:
    """CUDA only: inductor's async TP pass and symmetric memory for the tp group."""
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def apply_tp(model: nn.Module, tp_mesh, parallelism, compiled: bool = False, float8: str | None = None) -> nn.Module:
    """Build time: shard `model` (a whole model or one pipeline stage) over the tp mesh axis;
    `float8` tensorwise: the layer plan's styles mapped to torchao's float8 ones (parallel/float8.py)."""
    sequence_parallel, overlap = parallelism.sequence_parallel, tp_overlap(parallelism, tp_mesh.device_type, compiled)
    if overlap == "micro_pipeline":
        enable_micro_pipeline(tp_mesh)
    outer, _ = tp_plan(sequence_parallel)
    present = {path: style for path, style in outer.items() if _has_module(model, path)}
    parallelize_module(model, tp_mesh, present)
    shared_key, whole = model.cfg.qk_rope_head_dim if model.cfg.mla else 0, model.cfg.qk_norm_whole
    mtp = model.model.mtp or {}  # MTP modules (models/mtp.py): one more block each, with mtp_rows
    for name, block in [*model.model.layers.items(), *mtp.items()]:
        moe = hasattr(block, "block_sparse_moe")
        layer = tp_plan(sequence_parallel, moe, overlap == "chunked", shared_key, whole)[1]
        layer |= mtp_rows(sequence_parallel) if name in mtp else {}
        _shard_parameters(block, layer, tp_mesh)
        layer = {path: style for path, style in layer.items() if _has_module(block, path)}
        if float8 == "tensorwise":
            layer = float8_styles(layer, block, tp_mesh.device_type)
        parallelize_module(block, tp_mesh, layer)
        if overlap == "chunked":
            apply_async_tp(block, tp_mesh, sequence_parallel)
    return model


def _has_module(model: nn.Module, path: str) -> bool:
    """False for the parts a pipeline stage dropped (set to None)."""
    try:
        model.get_submodule(path)
        return True
    except AttributeError:
        return False


def loss_context(parallelism) -> contextlib.AbstractContextManager:
    """Step time: cross-entropy over logits sharded on the vocabulary (`loss_parallel`)
    when tp > 1; nothing otherwise."""
    return loss_parallel() if parallelism.loss_parallel else contextlib.nullcontext()


def match_grad_placements(params: list[nn.Parameter]) -> None:
    """Step time, after backward: give each DTensor gradient its parameter's placements. (A
    vocab-parallel embedding's gradient comes back replicated over tp; slicing it is local,
    no communication.)"""
    for q in params:
        if isinstance(q.grad, DTensor) and q.grad.placements != q.placements:
            q.grad = q.grad.redistribute(q.device_mesh, q.placements)


def vocab_layout(bias: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """ModelHooks.vocab_layout: the padded vocabulary's bias [padded vocab] laid out as the
    logits are (vocab-parallel: Shard(0) where they are sharded on the vocabulary), each rank
    keeping its slice of the same full bias (no communication); plain logits: the bias as it is."""
    if not isinstance(logits, DTensor):
        return bias
    last = logits.ndim - 1
    placements = [
        Shard(0) if isinstance(pl, Shard) and pl.dim % logits.ndim == last else Replicate() for pl in logits.placements
    ]
    return distribute_tensor(bias, logits.device_mesh, placements, src_data_rank=None)
