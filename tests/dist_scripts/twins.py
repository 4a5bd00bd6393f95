"""`python twins.py TWIN ARGS`: `python -m dtensor3d ARGS` with sums rounded in other places than the
default kernels, as a mesh rounds them too, three right ways (TWIN). Attention (a cp mesh's split):

- `math`: scaled_dot_product_attention on PyTorch's math backend (bf16 throughout), and gpt-oss's
  sink attention (models.layers.sink_attention, which SDPA does not run) rounding its output once
  after an fp32 `probs @ v` (v given in fp32) instead of its probabilities before it;
- `fp32`: scaled_dot_product_attention on q, k and v in fp32 (the default kernel), its output
  rounded once; the sink attention's `probs @ v` in fp32 on the heads' repeated v (so v's
  gradient is rounded before the repeat's sum, not after).

And float8's matmuls (a tp mesh's row-parallel products, a cp or dp mesh's weight gradients):

- `split`: every float8 matmul (torchao's `addmm_float8_unwrapped`, its `torch._scaled_mm`) as the
  sum of its two halves along the inner dimension, each rounded to the output dtype first, as tp 2's
  two partial products are before their all-reduce (an inner dimension not a multiple of 32 stays whole).

The combination matrix measures a float8 run's own noise with `math` and `fp32`, and `split` too
where the run has tp (test_matrix.twins_of, float8_bars)."""

import sys

import torch
import torch.nn.functional as F
import torchao.float8.float8_ops as float8_ops
from torch.nn.attention import SDPBackend, sdpa_kernel

import dtensor3d.models.layers as layers
import dtensor3d.parallel.context as context
from dtensor3d.__main__ import main

ROUND_PROBS, SDPA, ADDMM = layers.sink_attention, F.scaled_dot_product_attention, float8_ops.addmm_float8_unwrapped


def _unrounded(fn, q, *args, **kwargs):
    """fn with autocast off (under bf16 autocast -- a run without FSDP -- an fp32 matmul or SDPA would
    be cast back to bf16, and the twin would be its reference bit for bit), its output in the dtype
    the reference's attention gives: autocast's, else q's."""
    device = q.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q.dtype
    with torch.autocast(device, enabled=False):
        return fn(q, *args, **kwargs).to(dtype)


def sink_attention_fp32_out(q, k, v, sinks, mask):
    """layers.sink_attention with `probs @ v` in fp32 (v given in fp32), rounded after it."""
    return _unrounded(lambda q, k, v: ROUND_PROBS(q, k, v.float(), sinks, mask), q, k, v)


def sink_attention_repeated_fp32(q, k, v, sinks, mask):
    """layers.sink_attention with `probs @ v` in fp32 on the repeated heads' v, rounded after it."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return sink_attention_fp32_out(q, k, v, sinks, mask)


def sdpa_fp32(q, k, v, *args, **kwargs):
    """scaled_dot_product_attention in fp32, its output rounded once."""
    return _unrounded(lambda q, k, v: SDPA(q.float(), k.float(), v.float(), *args, **kwargs), q, k, v)


def addmm_split(a_data, a_scale, b_data, b_scale, output_dtype, output_scale=None, bias=None, use_fast_accum=False):
    """torchao's float8 matmul as two half products over the inner dimension, each rounded to
    output_dtype, then summed (the bias in the first). Its scales do not depend on that dimension."""
    k = a_data.shape[1]
    if k % 32:
        return ADDMM(a_data, a_scale, b_data, b_scale, output_dtype, output_scale, bias, use_fast_accum)
    h = k // 2
    first = ADDMM(a_data[:, :h], a_scale, b_data[:h], b_scale, output_dtype, output_scale, bias, use_fast_accum)
    return first + ADDMM(a_data[:, h:], a_scale, b_data[h:], b_scale, output_dtype, output_scale, None, use_fast_accum)


twin, args = sys.argv[1], sys.argv[2:]
if twin == "math":
    layers.sink_attention = context.sink_attention = sink_attention_fp32_out
    with sdpa_kernel([SDPBackend.MATH]):
        code = main(args)
elif twin == "fp32":
    layers.sink_attention = context.sink_attention = sink_attention_repeated_fp32
    F.scaled_dot_product_attention = sdpa_fp32
    code = main(args)
elif twin == "split":
    float8_ops.addmm_float8_unwrapped = addmm_split
    code = main(args)
else:
    raise SystemExit(f"error: TWIN={twin!r}: math, fp32 or split")
sys.exit(code)
