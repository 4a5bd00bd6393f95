"""README `data.kind: tokens` with a single token file, through the command line: a `.npy`
(any integer dtype; int32 here) and a nanoGPT `.bin` (raw uint16) holding the same ids
train to the same losses, bitwise, and the first step's loss is the initial model's loss on
windows of that file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import torch
import torch.nn.functional as F
from helpers import PARITY, ROOT

from dtensor3d.config.load import load_recipe
from dtensor3d.datasets.sources import make_source
from dtensor3d.models.llama import LlamaForCausalLM
from dtensor3d.parallel.data import local_batch
from dtensor3d.parallel.shards import init_weights

SMALL = ["model.num_hidden_layers=1", "training.steps=3", "training.eval_every=0", "checkpoint.resume=none"]


def train(run_dir, *overrides: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "dtensor3d", "train", PARITY, *SMALL, f"logging.run_dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_npy_and_bin_token_files_train_alike(tmp_path):
    # A learnable stream: runs of 'count up by a random stride', ids in 0..255 (vocab_size 256).
    rng = np.random.default_rng(0)
    starts, strides = rng.integers(0, 256, 400), rng.integers(1, 5, 400)
    ids = np.concatenate([(a + b * np.arange(40)) % 256 for a, b in zip(starts, strides)])
    np.save(tmp_path / "ids.npy", ids.astype(np.int32))
    ids.astype(np.uint16).tofile(tmp_path / "ids.bin")
    npy = train(tmp_path / "npy", "data.kind=tokens", f"data.path={tmp_path / 'ids.npy'}")
    bin_ = train(tmp_path / "bin", "data.kind=tokens", f"data.path={tmp_path / 'ids.bin'}")
    assert [r["step"] for r in npy] == [1, 2, 3]
    assert [(r["loss"], r["grad_norm"]) for r in npy] == [(r["loss"], r["grad_norm"]) for r in bin_]
    assert npy[-1]["loss"] < npy[0]["loss"]
    # The file is what was read: step 1's loss is the initial model's on 8 windows of it.
    recipe = load_recipe(PARITY, [*SMALL, "data.kind=tokens", f"data.path={tmp_path / 'ids.npy'}"])
    inputs, targets = local_batch(recipe, make_source(recipe), 0)
    for row in torch.cat([inputs, targets[:, -1:]], 1).numpy():
        assert any(np.array_equal(ids[i : i + len(row)], row) for i in np.flatnonzero(ids == row[0])), row
    model = LlamaForCausalLM(recipe.model)
    init_weights(model, recipe.training.seed)
    with torch.no_grad():
        want = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).item()
    assert abs(npy[0]["loss"] - want) <= 1e-5 * want, (npy[0]["loss"], want)


def test_a_token_file_of_exactly_one_sample_trains(tmp_path):
    """Issue 43 item 19: 33 tokens (sequence_length 32 + 1) passed the door and then died at
    the first step with a traceback; it is one sample, read by every row of every batch."""
    ids = (np.arange(33) * 7 % 256).astype(np.int32)
    np.save(tmp_path / "one.npy", ids)
    records = train(tmp_path / "run", "data.kind=tokens", f"data.path={tmp_path / 'one.npy'}")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[-1]["loss"] < records[0]["loss"]  # the one window, learned
    recipe = load_recipe(PARITY, [*SMALL, "data.kind=tokens", f"data.path={tmp_path / 'one.npy'}"])
    inputs, targets = local_batch(recipe, make_source(recipe), 2)
    assert all(row.tolist() == ids[:-1].tolist() for row in inputs) and targets[:, -1].eq(int(ids[-1])).all()
