"""Activation memory, measured: the bytes a forward leaves alive for its backward.

`kept_bytes(forward, model)` runs `forward()` while recording every tensor an operator
produces (a TorchDispatchMode), then sums the distinct storages still alive once it has
returned: what autograd saved (and the output), less the parameters themselves. It works
on any device and needs no allocator statistics (the CPU has none); bench/throughput.py and
tests/training/test_speed.py report it per recompute mode and dtype.
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _Outputs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.refs.extend(weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: its local piece
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # no storage (meta), or one freed (FSDP's resharded)
        return None


def kept_bytes(forward, model: torch.nn.Module):
    """(forward()'s result, bytes of operator outputs still alive after it, parameters excluded)."""
    mode = _Outputs()
    with mode:
        result = forward()
    gc.collect()
    params = {_storage_key(p) for p in model.parameters()}
    alive = {_storage_key(t) for ref in mode.refs if (t := ref()) is not None}
    return result, sum(key[1] for key in alive - params if key is not None and key[0] != 0)
