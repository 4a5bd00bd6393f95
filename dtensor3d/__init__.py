"""dtensor3d: 5-D parallel LLM training on PyTorch's DeviceMesh, DTensor, FSDP2 and pipelining.

Importing the package does not import torch; `dtensor3d.recipe` and `dtensor3d.plan` stay
torch-free so recipes are checked before any process starts. The library face is imported on
first use: `load_recipe`, `build_mesh`, `parallelize`, `setup` and `train_step` (docs/guides/library.md).
"""

import importlib

__version__ = "0.1.0"

# name -> the module that defines it; imported on first attribute access (PEP 562), so
# `import dtensor3d` stays torch-free.
_LAZY = {
    "load_recipe": "dtensor3d.config.load",
    "build_mesh": "dtensor3d.mesh",
    "parallelize": "dtensor3d.parallel.parallelize",
    "setup": "dtensor3d.training.train",
    "train_step": "dtensor3d.training.train",
    "TrainState": "dtensor3d.training.train",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'dtensor3d' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
