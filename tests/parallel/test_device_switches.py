"""Each speed feature's device switch, asked for "cuda" and "cpu" in one process (no ranks,
no GPU): FSDP2's mixed-precision policy (parallel/data.py `fsdp_policy`) and torch.compile's
targets and backend (parallel/compile.py `compile_targets`, `compile_backend`). The async
tp key's switch is tests/parallel/test_async_tp.py's, the experts' grouped_mm switch
tests/models/test_moe.py's."""

import pytest
import torch
import torch._functorch.config as functorch_config
import torch.distributed as dist
from helpers import MOE, PARITY
from torch.testing._internal.distributed.fake_pg import FakeStore

from dtensor3d.config.load import load_recipe
from dtensor3d.models import build_on_meta
from dtensor3d.parallel.compile import apply_compile, compile_backend, compile_targets
from dtensor3d.parallel.data import fsdp_policy


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_fsdp_policy_per_device_and_dtype(device):
    """bfloat16: bf16 gathered parameters over fp32 shards, gradients reduced in fp32;
    float32: nothing cast, fp32 reduction; the same policy on either device."""
    bf16, fp32 = fsdp_policy(device, "bfloat16"), fsdp_policy(device, "float32")
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert (fp32.param_dtype, fp32.reduce_dtype) == (None, torch.float32)
    assert bf16.output_dtype is None and bf16.cast_forward_inputs  # FSDP2's defaults kept
    assert fsdp_policy(device, "bfloat16") == fsdp_policy("cpu", "bfloat16")


def test_compile_backend_and_targets_per_device():
    """inductor on both devices; every block of a dense model, the attention alone of a layer
    with experts (tests/recipes/moe_parity.yaml: 4 such layers)."""
    assert compile_backend("cuda") == compile_backend("cpu") == "inductor"
    dense = build_on_meta(load_recipe(PARITY).model)
    assert compile_targets(dense) == [(f"model.layers.{i}", b) for i, b in dense.model.layers.items()]
    moe = build_on_meta(load_recipe(MOE).model)
    targets = compile_targets(moe)
    assert [n for n, _ in targets] == [f"model.layers.{i}.self_attn" for i in moe.model.layers]
    assert all(t is moe.model.layers[n.split(".")[2]].self_attn for n, t in targets)


def test_autograd_cache_off_with_more_than_one_rank(monkeypatch):
    """One process keeps AOTAutograd's on-disk cache; a world of 2 (torch's in-process fake
    process group: only the world size is read) turns it off, as every rank of a real run
    does (parallel/compile.py `apply_compile`: a warm cache handed ranks of one tp group
    another group's graph, matrix run 15 lost 4 of 8 ranks at step 1)."""
    monkeypatch.setattr(functorch_config, "enable_autograd_cache", True)
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", False)
    model = build_on_meta(load_recipe(PARITY).model)
    apply_compile(model)
    assert functorch_config.enable_autograd_cache
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        apply_compile(model)
    finally:
        dist.destroy_process_group()
    assert not functorch_config.enable_autograd_cache
