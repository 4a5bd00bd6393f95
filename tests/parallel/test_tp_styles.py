"""parallel/tensor.py's own ParallelStyle for the norms under sequence parallelism, against
torch's: one process, a real one-rank gloo group."""

from __future__ import annotations


def test_sequence_shard_norm_is_sequence_parallel_without_dtensor_ops():
    """SequenceShardNorm gives what torch's SequenceParallel gives an RMSNorm -- the output
    sharded on the sequence, the input's and the weight's gradients (the weight's partial over
    tp, summed once per step) -- bitwise, with none of the norm's ops dispatched on a DTensor
    (SequenceParallel: 7 forward, 18 backward)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from dtensor3d.models.layers import RMSNorm
    from dtensor3d.parallel.tensor import SequenceShardNorm

    class DTensorOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += any(isinstance(a, DTensor) for a in tree_flatten((args, kwargs))[0])
            return func(*args, **(kwargs or {}))

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    got = {}
    try:
        mesh = init_device_mesh("cpu", (1,))
        for name, style in (("torch", SequenceParallel()), ("ours", SequenceShardNorm())):
            torch.manual_seed(0)
            norm = RMSNorm(8, 1e-5)
            with torch.no_grad():
                norm.weight.uniform_()
            parallelize_module(norm, mesh, style)
            x = torch.randn(2, 4, 8, requires_grad=True)
            with DTensorOps() as forward:
                y = norm(x)
            with DTensorOps() as backward:
                (y.to_local() ** 2).sum().backward()
            grad = norm.weight.grad
            got[name] = (y.placements, grad.placements, y.to_local(), x.grad, grad.to_local())
            got[name] += (forward.count, backward.count)
    finally:
        dist.destroy_process_group()
    assert [str(p) for p in got["ours"][:2]] == ["(Shard(dim=1),)", "(Partial(sum),)"]
    assert got["ours"][:2] == got["torch"][:2]
    for a, b in zip(got["ours"][2:5], got["torch"][2:5], strict=True):
        assert torch.equal(a, b)
    assert got["ours"][5:] == (0, 1) and min(got["torch"][5:]) > 5, (got["ours"][5:], got["torch"][5:])
