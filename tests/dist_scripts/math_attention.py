"""`python -m dtensor3d ARGS` with attention rounded in other places than the default kernels
(what a cp mesh's attention does too): scaled_dot_product_attention on PyTorch's math backend,
and gpt-oss's sink attention (models.layers.sink_attention, which SDPA does not run) rounding
its output once after an fp32 `probs @ v` instead of its probabilities before it -- both right.
The combination matrix measures a float8 run's own noise with it (test_matrix.float8_bars)."""

import sys

from torch.nn.attention import SDPBackend, sdpa_kernel

import dtensor3d.models.layers as layers
import dtensor3d.parallel.context as context
from dtensor3d.__main__ import main

ROUND_PROBS = layers.sink_attention


def sink_attention_fp32_out(q, k, v, sinks, mask):
    """layers.sink_attention with `probs @ v` in fp32 (v given in fp32), rounded to v's dtype after it."""
    return ROUND_PROBS(q, k, v.float(), sinks, mask).to(v.dtype)


layers.sink_attention = context.sink_attention = sink_attention_fp32_out
with sdpa_kernel([SDPBackend.MATH]):
    code = main(sys.argv[1:])
sys.exit(code)
