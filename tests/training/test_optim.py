"""training/optim.py's AdamW: DTensor parameters take the foreach kernels on every device
(torch picks them on CUDA only; on CPU its loop costs a Python dispatch per op and
parameter), plain tensors torch's own choice; the same bits as torch's per-parameter loop
either way (DTensors on a one-rank mesh in this process); weight decay on matrices only."""

from __future__ import annotations

import torch
from helpers import PARITY, one_rank_group
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dtensor3d.config.load import load_recipe
from dtensor3d.parallel.shards import full_tensor
from dtensor3d.training.optim import adamw

LRS = (1e-2, 7e-3, 3e-3, 1e-3)


def _params(mesh=None) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    shapes = [(64, 32), (32,), (7, 5, 3)]
    tensors = [torch.randn(s) for s in shapes]
    if mesh is not None:
        tensors = [distribute_tensor(t, mesh, [Shard(0)]) for t in tensors]
    return [torch.nn.Parameter(t) for t in tensors]


def _steps(params, opt) -> None:
    for i, lr in enumerate(LRS):
        for g in opt.param_groups:
            g["lr"] = lr
        torch.manual_seed(100 + i)
        for p in params:
            g = torch.randn(p.shape)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements) if hasattr(p, "device_mesh") else g
        opt.step()


def _same_as_the_loop(mesh=None) -> None:
    cfg = load_recipe(PARITY, []).optimizer
    ours_params, ref_params = _params(mesh), _params(mesh)
    ours = adamw(ours_params, cfg)
    index = {id(p): i for i, p in enumerate(ours_params)}
    groups = [{"params": [ref_params[index[id(p)]] for p in g["params"]], "weight_decay": g["weight_decay"]}
              for g in ours.param_groups]  # fmt: skip
    ref = torch.optim.AdamW(groups, lr=LRS[0], betas=cfg.betas, eps=cfg.eps, foreach=False)
    assert ours.defaults["foreach"] is (True if mesh else None)  # None: torch's own choice (CPU: the loop)
    _steps(ours_params, ours)
    _steps(ref_params, ref)
    for p, q in zip(ours_params, ref_params, strict=True):
        assert torch.equal(full_tensor(p), full_tensor(q))
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(full_tensor(ours.state[p][key]), full_tensor(ref.state[q][key]))
    decays = {len(g["params"]): g["weight_decay"] for g in ours.param_groups}
    assert decays == {2: cfg.weight_decay, 1: 0.0}  # the two matrices decay, the bias does not


def test_foreach_adamw_equals_the_per_parameter_loop_bitwise():
    _same_as_the_loop()


def test_foreach_adamw_equals_the_loop_on_dtensor_parameters():
    with one_rank_group():
        _same_as_the_loop(init_device_mesh("cpu", (1,), mesh_dim_names=("dp_cp",)))
