"""Live tensor bytes of one process, counted without CUDA: every tensor storage an op creates
is recorded once (by its StorageImpl) with its size, and forgotten when torch frees it (a
weakref finalizer on the storage's preserved Python object). `now` is the bytes alive,
`peak` the most alive at once since the last `reset_peak`.

A TorchDispatchMode sees the outputs of every op dispatched while it is active -- factory
functions, views (same storage: counted once), collectives' outputs, autograd's gradient
buffers (CPU backward runs on the calling thread), FSDP2's padded shards and all-gather
buffers, pipelining's receive buffers. FSDP2 frees and re-allocates its gathered parameters
by `UntypedStorage.resize_`, which no op dispatch shows: that method is wrapped while the
mode is active. Tensors made before it was entered can be added with `track`. What it
cannot see: memory that is not a tensor storage (gloo's internal buffers, Python objects,
the allocator's slack). A wrapper subclass (torchao's float8 weights and their optimizer
states) has a storage of its full size but no data: its inner tensors are counted instead.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.sizes: dict[int, int] = {}  # StorageImpl address -> bytes
        self.now = self.peak = 0

    def track(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        if isinstance(t, DTensor):
            t = t.to_local()
        if is_traceable_wrapper_subclass(t):  # e.g. torchao's float8 weights: the inner tensors hold the bytes
            for name in t.__tensor_flatten__()[0]:
                self.track(getattr(t, name))
            return
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.sizes:
            return
        self.sizes[key] = storage.nbytes()
        self.now += self.sizes[key]
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.now -= self.sizes.pop(key, 0)

    def _resized(self, storage, nbytes: int) -> None:
        key = storage._cdata
        if key in self.sizes:
            self.now += nbytes - self.sizes[key]
            self.sizes[key] = nbytes
            self.peak = max(self.peak, self.now)

    def __enter__(self):
        real, mode = torch.UntypedStorage.resize_, self
        self._real_resize = real

        def resize_(storage, nbytes):
            out = real(storage, nbytes)
            mode._resized(storage, nbytes)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._real_resize
        return super().__exit__(*exc)

    def reset_peak(self) -> None:
        self.peak = self.now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor unwraps into plain-tensor ops, seen below
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self.track(t)
        return out
