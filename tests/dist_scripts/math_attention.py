"""`python math_attention.py TWIN ARGS`: `python -m dtensor3d ARGS` with attention rounded in other
places than the default kernels (what a cp mesh's attention does too), two right ways (TWIN):

- `math`: scaled_dot_product_attention on PyTorch's math backend (bf16 throughout), and gpt-oss's
  sink attention (models.layers.sink_attention, which SDPA does not run) rounding its output once
  after an fp32 `probs @ v` (v given in fp32) instead of its probabilities before it;
- `fp32`: scaled_dot_product_attention on q, k and v in fp32 (the default kernel), its output
  rounded once; the sink attention's `probs @ v` in fp32 on the heads' repeated v (so v's
  gradient is rounded before the repeat's sum, not after).

The combination matrix measures a float8 run's own noise with both (test_matrix.float8_bars)."""

import sys

import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import dtensor3d.models.layers as layers
import dtensor3d.parallel.context as context
from dtensor3d.__main__ import main

ROUND_PROBS, SDPA = layers.sink_attention, F.scaled_dot_product_attention


def sink_attention_fp32_out(q, k, v, sinks, mask):
    """layers.sink_attention with `probs @ v` in fp32 (v given in fp32), rounded to v's dtype after it."""
    return ROUND_PROBS(q, k, v.float(), sinks, mask).to(v.dtype)


def sink_attention_repeated_fp32(q, k, v, sinks, mask):
    """layers.sink_attention with `probs @ v` in fp32 on the repeated heads' v, rounded after it."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return ROUND_PROBS(q, k, v.float(), sinks, mask).to(v.dtype)


def sdpa_fp32(q, k, v, *args, **kwargs):
    """scaled_dot_product_attention in fp32, its output rounded to q's dtype once."""
    return SDPA(q.float(), k.float(), v.float(), *args, **kwargs).to(q.dtype)


twin, args = sys.argv[1], sys.argv[2:]
if twin == "math":
    layers.sink_attention = context.sink_attention = sink_attention_fp32_out
    with sdpa_kernel([SDPBackend.MATH]):
        code = main(args)
elif twin == "fp32":
    layers.sink_attention = context.sink_attention = sink_attention_repeated_fp32
    F.scaled_dot_product_attention = sdpa_fp32
    code = main(args)
else:
    raise SystemExit(f"error: TWIN={twin!r}: math or fp32")
sys.exit(code)
