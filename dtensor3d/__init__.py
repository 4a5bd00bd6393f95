"""dtensor3d: 5-D parallel LLM training on PyTorch's DeviceMesh, DTensor, FSDP2 and pipelining.

Importing the package does not import torch; `dtensor3d.recipe` and `dtensor3d.plan` stay
torch-free so recipes are checked before any process starts.
"""

__version__ = "0.1.0"
