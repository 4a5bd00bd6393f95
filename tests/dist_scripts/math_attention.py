"""`python -m dtensor3d ARGS` with scaled_dot_product_attention on PyTorch's math backend: the
same run, its attention rounded in other places than the default kernel's (what a cp mesh's
attention does too). The combination matrix measures a float8 run's own noise with it."""

import sys

from torch.nn.attention import SDPBackend, sdpa_kernel

from dtensor3d.__main__ import main

with sdpa_kernel([SDPBackend.MATH]):
    code = main(sys.argv[1:])
sys.exit(code)
