"""Topology-independent init: full weights gathered from a dp2 x tp2 x pp2 mesh (FSDP2 +
DTensor TP + pipeline stages) equal the 1-process init bit for bit."""

import torch
from helpers import PARITY, torchrun
from safetensors.torch import load_file


def gathered(out, nproc, overrides):
    out.mkdir()
    torchrun(nproc, ["tests/dist_scripts/dump_init.py", str(out), PARITY, *overrides])
    weights = {}
    for f in sorted(out.glob("rank*.safetensors")):
        weights.update(load_file(f))
    return weights


def test_init_bitwise_across_meshes(tmp_path):
    one = gathered(tmp_path / "one", 1, [])
    many = gathered(tmp_path / "eight", 8, ["parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2"])
    assert sorted(one) == sorted(many)
    assert "model.layers.3.self_attn.q_proj.weight" in one and "lm_head.weight" in one
    for name in one:
        assert torch.equal(one[name], many[name]), name
    # Parameters are not all alike: different names draw different values.
    assert not torch.equal(one["model.layers.0.mlp.up_proj.weight"], one["model.layers.1.mlp.up_proj.weight"])
