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
(PrepareFloat8ModuleInput: its own amax, and a 1-byte gather); plan counts the CPU path."""

from __future__ import annotations

from ..config.low_precision import float8_recipe, float8_weight
from .params import sizes
from .shapes import param_shapes, tp_dim

AMAX = 8  # torchao reduces amaxes as float64


def tp_scale_bytes(recipe, layer: int) -> tuple[int, int]:
    """(forward, backward) bytes of decoder layer `layer`'s float8 scale all-reduces over tp,
    one microbatch (0, 0 without float8 or tp)."""
    name, p = float8_recipe(recipe.training), recipe.parallelism
    if name is None or not p.tp_enabled:
        return 0, 0
    tokens, prefix = sizes(recipe).tokens, f"model.layers.{layer}."
    torch_rows = p.sequence_parallel and recipe.training.device != "cuda"  # torch's RowwiseParallel
    fwd = bwd = 0
    for weight, shape in param_shapes(recipe.model).items():
        dim = tp_dim(weight, recipe.model)
        if not weight.startswith(prefix) or dim is None or not float8_weight(weight, tuple(shape)):
            continue
        out, inner = shape
        if name == "rowwise":
            fwd += (tokens + out) * (dim == 1)
            bwd += (tokens + inner) * (dim == 0)
        else:
            fwd += 1 + (dim == 1)  # the weight; a row-parallel linear's input
            bwd += 1 + (dim == 0) + (dim == 1 and torch_rows)
    return AMAX * fwd, AMAX * bwd
