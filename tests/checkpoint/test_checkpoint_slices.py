"""Checkpoints that never gather a whole model: at world 4 no rank issues an all-gather (or
any gather, broadcast, scatter, all-to-all, send/recv) or calls DTensor.full_tensor /
redistribute while it saves (dp2 x tp2: FSDP2 over TP, _StridedShard placements), resumes
on another mesh (tp2 x pp2), or initialises from Hugging Face weights (dp2 x tp2); and every
tensor saved or loaded equals the full tensor (compared afterwards, outside the count).
Plus the pieces in one process: a layout's boxes, region reads across slices, the format."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from helpers import PARITY, torchrun
from safetensors.torch import load_file

from dtensor3d.__main__ import main
from dtensor3d.checkpoint.check import check_checkpoint
from dtensor3d.checkpoint.format import SLICES, save_tensors, seal
from dtensor3d.checkpoint.slices import SliceReader
from dtensor3d.errors import CheckpointError

SCRIPT = "tests/dist_scripts/ckpt_slices.py"
DP2_TP2 = ["parallelism.dp=2", "parallelism.tp=2"]


def rank_records(stdout: str) -> list[dict]:
    decoder, recs, at = json.JSONDecoder(), [], stdout.find('{"rank"')
    while at >= 0:  # the ranks print concurrently: take each object wherever it starts
        rec, end = decoder.raw_decode(stdout, at)
        recs.append(rec)
        at = stdout.find('{"rank"', end)
    assert sorted(r["rank"] for r in recs) == [0, 1, 2, 3], stdout[-3000:]
    return recs


def assert_no_gather(recs: list[dict], kinds_allowed=("allreduce_.default", "barrier.default")) -> None:
    for r in recs:
        assert r["gathers"] == 0, r
        assert set(r["collectives"]) <= set(kinds_allowed), r
        assert r["mismatched"] == [] and r["compared"] > 0, r


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("slices")
    ck = root / "ck"
    out = torchrun(4, [SCRIPT, "save", str(ck), PARITY, *DP2_TP2, f"checkpoint.dir={ck}"]).stdout
    return rank_records(out), ck / "step_00000002", root


def test_save_gathers_nothing(saved):
    recs, step, _ = saved
    assert_no_gather(recs)
    # The layout under test is FSDP2 over TP, whose local pieces _StridedShard describes.
    assert any("_StridedShard" in p for p in recs[0]["placements"]), recs[0]["placements"]
    # The Saver's agreement flags are the only all-reduces: a few int32 elements, no tensor data.
    assert all(r["allreduce_elems"] <= 8 for r in recs), recs
    # Every rank wrote its own distinct slices, and they tile each tensor exactly once.
    assert len(list(step.glob("model-*.safetensors"))) == 4
    record = check_checkpoint(str(step), None, hashes=True)
    slices = record["tensors"]["model"]["model.layers.0.mlp.gate_proj.weight"]["slices"]
    assert sorted(s["offset"][0] for s in slices) == [0, 32, 64, 96] and record["version"] == 2


def test_resume_on_another_mesh_gathers_nothing(saved):
    _, step, _ = saved
    out = torchrun(4, [SCRIPT, "load", str(step), PARITY, "parallelism.tp=2", "parallelism.pp=2"]).stdout
    assert_no_gather(rank_records(out))


def test_init_from_hf_gathers_nothing(saved):
    _, step, root = saved
    hf = root / "hf"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["export-hf", str(step), str(hf)]) == 0
    out = torchrun(4, [SCRIPT, "hf", str(hf), PARITY, *DP2_TP2, f"checkpoint.init_from_hf={hf}"]).stdout
    assert_no_gather(rank_records(out))


def _write_slices(path, name, full, cuts):
    """Row slices of `full` at the row offsets `cuts` into one file, with their places."""
    tensors, places = {}, {}
    for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
        tensors[f"{name}@{k}"] = full[a:b]
        places[f"{name}@{k}"] = {"name": name, "offset": [a, 0], "shape": list(full.shape)}
    save_tensors(tensors, str(path), {SLICES: json.dumps(places)})


def test_region_reads_cross_slices_and_gaps_are_refused(tmp_path):
    full = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6)
    step = tmp_path / ".tmp-step"
    step.mkdir()
    _write_slices(step / "model-stage00.safetensors", "w", full, [0, 3, 7, 10])
    assert load_file(step / "model-stage00.safetensors")["w@1"].equal(full[3:7])  # plain safetensors
    seal(str(step), {"step": 0, "recipe": {}})
    index = json.loads((step / "state.json").read_text())["tensors"]["model"]
    reader = SliceReader(str(step), index)
    assert reader.read("w", [2, 1], [6, 4]).equal(full[2:8, 1:5])  # three slices meet this region
    assert reader.get("w").equal(full)
    index["w"]["slices"].pop(1)  # a gap
    with pytest.raises(CheckpointError, match="cover 8 of the 24 elements"):
        SliceReader(str(step), index).read("w", [2, 1], [6, 4])


def test_streamed_safetensors_match_safetensors_own(tmp_path):
    """save_tensors writes (tensor by tensor, lazily) what safetensors reads back, every dtype."""
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(4).to(torch.bfloat16),
        "c": torch.tensor(7.0),
        "d": torch.arange(6, dtype=torch.int64).reshape(2, 3)[:, 1:],  # not contiguous
        "e": torch.zeros(0, 4),
    }
    lazy = {"f": (torch.float16, [2, 2], lambda: torch.ones(2, 2, dtype=torch.float16))}
    save_tensors({**tensors, **lazy}, str(tmp_path / "x.safetensors"))
    back = load_file(tmp_path / "x.safetensors")
    assert sorted(back) == ["a", "b", "c", "d", "e", "f"]
    assert all(back[k].equal(v) and back[k].dtype == v.dtype for k, v in tensors.items())
    assert back["f"].equal(torch.ones(2, 2, dtype=torch.float16))
