"""training.float8 under tp for `plan`: the all-reduces of torchao's scales. Pure Python.

A float8 cast scales its tensor by the tensor's amax (tensorwise: one, over the whole tensor;
rowwise: one per row or column, along the cast's axis). Under tp the cast's tensor is a
DTensor; where it is sharded along the axis the amax runs over, the amax is a partial max
that torchao's amax_to_scale reduces when it casts it to float64: one tp all-reduce of
float64 values (8 B each) per such cast. Which casts meet a sharded axis, per converted
linear and microbatch (counted on the parity model at tp 2 by intercepting every collective,
both tp modes, with torchao's call site of each):

- rowwise (torch's tp styles): a row-parallel linear (input and weight sharded on the
  contracted dim) forward reduces its input's per-token amax (tokens values) and its
  weight's per-output-row amax (out values); a column-parallel one (output sharded)
  backward reduces its output gradient's per-token amax (tokens) and, for the input
  gradient, its weight's per-input-column amax (in values).
- tensorwise (one value per cast): every tp-split linear forward reduces its weight's amax
  and backward its output gradient's (Float8Linear's backward); a column-parallel linear
  under torchao's Float8ColwiseParallel also the gradient its style casts; a row-parallel
  one forward its input's (Float8RowwiseParallel's input cast, or Float8Linear's under
  torch's RowwiseParallel, which off CUDA takes the sequence-parallel row projections,
  parallel/float8.float8_styles: their backward casts the input again, one more).

On CUDA tensorwise's sequence-parallel block input is gathered in float8
(PrepareFloat8ModuleInput: its own amax, and a 1-byte gather); plan counts the CPU path.

Under cp tensorwise (parallel/float8.scale_over_cp) each converted linear casts its input
(forward) and output gradient (backward) itself, the bf16 amax (2 B) all-reduced over cp
(`cp_scale_bytes`) and, where tp shards the tensor (a row-parallel input, a column-parallel
output gradient), over tp first; torchao's float8 tp styles are off, so of torchao's own
casts only the weight's remain, forward and again in backward (8 B over tp each), or none
where FSDP gathers the weights cast (`fsdp_all_gather`: cp > 1 shards them over dp x cp), whose
per-step scale precompute reduces each tp-split weight's amax over tp (`fsdp_scale_tp_bytes`)."""

from __future__ import annotations

from ..config.low_precision import float8_all_gather, float8_recipe, float8_weight
from .params import sizes
from .shapes import param_shapes, tp_dim

AMAX = 8  # torchao reduces amaxes as float64
BF16 = 2  # scale_over_cp reduces the bf16 amax itself


def _split_linears(recipe, layer: int):
    """(tp dim, shape) of decoder layer `layer`'s float8-converted linears that tp splits."""
    prefix = f"model.layers.{layer}."
    for weight, shape in param_shapes(recipe.model).items():
        dim = tp_dim(weight, recipe.model)
        if weight.startswith(prefix) and dim is not None and float8_weight(weight, tuple(shape)):
            yield dim, shape


def _torch_rows(recipe) -> bool:
    """Sequence-parallel row projections under torch's RowwiseParallel (off CUDA,
    parallel/float8.float8_styles): their backward casts the input again."""
    return recipe.parallelism.sequence_parallel and recipe.training.device != "cuda"


def tp_scale_bytes(recipe, layer: int) -> tuple[int, int]:
    """(forward, backward) bytes of decoder layer `layer`'s float8 scale all-reduces over tp,
    one microbatch (0, 0 without float8 or tp)."""
    name, p = float8_recipe(recipe.training), recipe.parallelism
    if name is None or not p.tp_enabled:
        return 0, 0
    tokens, torch_rows = sizes(recipe).tokens, _torch_rows(recipe)
    cast = AMAX * (not float8_all_gather(recipe.training, p))  # a weight's cast; FSDP's float8 gather: none
    fwd = bwd = 0
    for dim, (out, inner) in _split_linears(recipe, layer):
        if name == "tensorwise" and p.cp_enabled:  # the weight's casts; a sharded input's or gradient's (bf16)
            fwd += cast + BF16 * (dim == 1)
            bwd += cast + BF16 * (dim == 0)
        elif name == "rowwise":
            fwd += AMAX * (tokens + out) * (dim == 1)
            bwd += AMAX * (tokens + inner) * (dim == 0)
        else:
            fwd += cast + AMAX * (dim == 1)  # the weight; a row-parallel linear's input
            bwd += cast + AMAX * ((dim == 0) + (dim == 1 and torch_rows))
    return fwd, bwd


def tp_weight_pass_bytes(recipe, layer: int) -> int:
    """Bytes of decoder layer `layer`'s float8 scale all-reduces over tp in each weight backward W
    (zbv, dualpipev: autograd.grad to the weights alone; collectives.split_passes), counted on the
    matrix's runs (2026-12-06): rowwise casts again everything its backward casts (the layer's
    backward bytes: qwen3_moe ep 2 x tp 2 x zbv, 4 W a stage); tensorwise what each weight gradient
    reads where tp shards it: a column-parallel linear's output gradient, a row-parallel one's input
    (twice under torch's RowwiseParallel: parity model, tp 2 sp x dualpipev, 9 a layer). Under cp
    tensorwise (its own casts, scale_over_cp) not counted: not measured."""
    name, p = float8_recipe(recipe.training), recipe.parallelism
    if name == "rowwise":
        return tp_scale_bytes(recipe, layer)[1]
    if name is None or not p.tp_enabled or p.cp_enabled:
        return 0
    rows = 1 + _torch_rows(recipe)
    return AMAX * sum((dim == 0) + (dim == 1) * rows for dim, _ in _split_linears(recipe, layer))


def fsdp_scale_tp_bytes(recipe, layers: list[int]) -> int:
    """Per step, FSDP's float8 all-gather under tp: torchao's precompute of the next gathers'
    scales (parallel/float8.precompute_scales) reduces each tp-split converted weight's amax
    over tp too, one fp32 value each (the dp side: collectives.dp_bytes)."""
    p = recipe.parallelism
    if not (p.tp_enabled and float8_all_gather(recipe.training, p)):
        return 0
    prefixes = tuple(f"model.layers.{i}." for i in layers)
    shapes = param_shapes(recipe.model).items()
    return 4 * sum(
        w.startswith(prefixes) and tp_dim(w, recipe.model) is not None and float8_weight(w, tuple(s)) for w, s in shapes
    )


def cp_scale_bytes(recipe, layer: int) -> int:
    """Bytes of decoder layer `layer`'s amax all-reduces over cp, per cast direction and
    microbatch (forward: the inputs', backward: the output gradients'): under cp tensorwise one
    bf16 value per converted linear (parallel/float8.scale_over_cp); 0 otherwise."""
    if float8_recipe(recipe.training) != "tensorwise" or not recipe.parallelism.cp_enabled:
        return 0
    prefix = f"model.layers.{layer}."
    shapes = param_shapes(recipe.model).items()
    return BF16 * sum(w.startswith(prefix) and float8_weight(w, tuple(s)) for w, s in shapes)
