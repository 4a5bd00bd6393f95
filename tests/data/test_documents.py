"""Document masking (data.document_masking): each window's positions and document ids from
a prepared directory's document offsets, the door, plan's line, and loss parity of packed
short documents (straddling cp chunks, windows and microbatches) at dp 2 x cp 2 (HSDP), cp 2 x tp 2
(REDUCE_SCATTER) and pp 2 x tp 2 against one process, whose first loss is recomputed here."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import PARITY, assert_parity, check_comm, cli, one_error_line, prepare_packed, scheduled_lrs, train_metrics

from dtensor3d.checkpoint.check import check_trajectory
from dtensor3d.config.load import load_recipe
from dtensor3d.datasets.sources import make_source
from dtensor3d.datasets.tokens import window_documents
from dtensor3d.errors import CheckpointError
from dtensor3d.models import build_on_meta, materialize
from dtensor3d.models.layers import ModelHooks
from dtensor3d.parallel.data import local_batch, local_documents
from dtensor3d.parallel.shards import init_weights


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """helpers.prepare_packed: 300 documents of 2 to 21 tokens (EOS included)."""
    return prepare_packed(tmp_path_factory.mktemp("packed"))


def data_overrides(path) -> list[str]:
    return ["data.kind=tokens", f"data.path={path}", "model.vocab_size=264", "data.document_masking=true"]


def test_window_documents_restart_at_each_document_and_at_the_window():
    offsets = np.array([0, 4, 5, 9, 20])
    positions, ids = window_documents(offsets, 2, 9)  # tokens 2..10: doc 0 (from its middle), 1, 2, 3
    assert positions.tolist() == [0, 1, 0, 0, 1, 2, 3, 0, 1]
    assert ids.tolist() == [0, 0, 1, 2, 2, 2, 2, 3, 3]


def test_prepared_windows_documents_follow_the_eos(packed):
    # Each document's first token (position 0, past the window's first) follows an EOS, and
    # every token after an EOS starts a document: the offsets and the tokens agree.
    recipe = load_recipe(PARITY, data_overrides(packed))
    eos = json.loads((packed / "meta.json").read_text())["tokenizer"]["eos_id"]
    source = make_source(recipe)
    for split in (source, make_source(recipe, "validation")):
        for i in range(6):
            tokens, (positions, ids) = split(i), split.documents(i)
            starts = (positions[1:] == 0).nonzero().flatten() + 1
            assert starts.tolist() == ((tokens[:-1] == eos).nonzero().flatten() + 1).tolist()
            edges = [0, *starts.tolist(), len(tokens)]
            expected = torch.cat([torch.arange(b - a) for a, b in zip(edges, edges[1:])])
            assert torch.equal(positions, expected) and len(starts) >= 1 and ids[-1] == len(starts)


def test_document_masking_needs_a_prepared_directory(tmp_path):
    line = one_error_line(cli("validate", PARITY, "data.document_masking=true"))
    assert "data.document_masking" in line and "synthetic" in line and "prepared directory" in line
    np.save(tmp_path / "t.npy", np.arange(100, dtype=np.int32))
    args = [f"data.path={tmp_path / 't.npy'}", "data.kind=tokens", "training.eval_every=0"]
    line = one_error_line(cli("validate", PARITY, *args, "data.document_masking=true"))
    assert "data.document_masking" in line and "t.npy" in line and "single token file" in line


def test_resume_keeps_document_masking(packed):
    # A resume continues the saved trajectory: switching the masking is refused (a checkpoint
    # from before the key existed counts as unmasked).
    recipe = load_recipe(PARITY, data_overrides(packed))
    saved = recipe.to_dict()
    older = {"step": 2, "recipe": dict(saved, data={k: v for k, v in saved["data"].items() if k != "document_masking"})}
    with pytest.raises(CheckpointError, match=r"data\.document_masking=False but the recipe has True"):
        check_trajectory(older, recipe, "state.json")
    check_trajectory({"step": 2, "recipe": saved}, recipe, "state.json")


def test_plan_says_what_document_masking_saves(packed):
    out = cli("plan", PARITY, *data_overrides(packed))
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("document masking"))
    assert "attention" in line and "FLOPs" in line


def test_recompute_modes_pass_the_documents_through():
    # Activation checkpointing re-runs each block with the same keywords: full and selective
    # recompute give the gradients of no recompute, and the documents change them.
    recipe = load_recipe(PARITY, ["model.num_hidden_layers=1"])
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    docs = {"position_ids": torch.cat([torch.arange(10), torch.arange(22)]).expand(2, 32)}
    docs["document_ids"] = (torch.arange(32) >= 10).long().expand(2, 32)
    grads = {}
    for mode, given in (("none", docs), ("full", docs), ("selective", docs), ("none ", {})):
        model = materialize(build_on_meta(recipe.model, hooks=ModelHooks(recompute=mode.strip())), "cpu")
        init_weights(model, 1)
        model(ids, **given).square().mean().backward()
        grads[mode] = torch.cat([q.grad.flatten() for q in model.parameters()])
    assert torch.equal(grads["full"], grads["none"]) and torch.equal(grads["selective"], grads["none"])
    assert (grads["none "] - grads["none"]).abs().max() > 1e-6


def first_loss(recipe, masked: bool) -> float:
    """Step 1's loss computed here: the run's initial weights over global batch 0, one process."""
    model = materialize(build_on_meta(recipe.model), "cpu")
    init_weights(model, recipe.training.seed)
    source = make_source(recipe)
    inputs, targets = local_batch(recipe, source, 0)
    docs = local_documents(recipe, source, 0) if masked else {}
    with torch.no_grad():
        return F.cross_entropy(model(inputs, **docs).flatten(0, 1), targets.flatten()).item()


MESHES = {
    # HSDP: FSDP over dp_shard x cp (2), replicated over dp_replicate (2)
    "dp2_cp2_hsdp": ["parallelism.dp=2", "parallelism.cp=2", "parallelism.dp_mode=hybrid", "parallelism.dp_shard=1"],
    # tp x cp: the logged loss summed over cp too (torchtitan #3280 logged half of it: rel 0.5 here).
    "cp2_tp2_reduce_scatter": ["parallelism.cp=2", "parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER"],
    "pp2_tp2": ["parallelism.pp=2", "parallelism.tp=2"],
}


def test_document_masking_parity_across_meshes(packed, tmp_path):
    # 2 steps with validation at the last, microbatches of 2 (4 per step at pp 2). The
    # 1-process run's first loss is the masked loss recomputed here (and not the unmasked
    # one, 3e-4 away), so the runs compared do mask.
    common = [*data_overrides(packed), "training.steps=2", "training.eval_every=2", "training.micro_batch_size=2"]
    one = train_metrics(tmp_path / "one", 1, common)
    recipe = load_recipe(PARITY, common)
    masked, unmasked = first_loss(recipe, True), first_loss(recipe, False)
    assert abs(one[0]["loss"] - masked) <= 1e-6 * masked < abs(unmasked - masked) / 10, (one[0], masked, unmasked)
    source = make_source(recipe)
    positions = local_documents(recipe, source, 0)["position_ids"]  # global batch 0: 8 windows of 32
    assert (positions[:, 8::8] > 0).sum() >= 8  # documents running over cp 2's chunk edges (every 8 tokens)
    offsets = np.fromfile(packed / "train_docs.bin", "<i8")
    assert sum(source.window(i) * 32 not in offsets for i in range(8)) >= 4  # windows that begin inside a document
    lrs = scheduled_lrs(PARITY, common)
    for name, mesh in MESHES.items():
        got = train_metrics(tmp_path / name, 4, [*common, *mesh, "logging.layout=true"])
        worst = assert_parity(got, one, lrs)
        # plan's estimate of each collective's bytes (the document ids' gather under cp included)
        check_comm(tmp_path / name, load_recipe(PARITY, [*common, *mesh]))
        print(name, worst)
