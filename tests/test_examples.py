"""examples/ run for real (docs/guides/library.md): your own loop on the recipe's mesh and
model matches launch.sh on the same recipe, and your own model with your own tp plan matches
its one-process run. Both start processes: slow (not in tests/conftest.py's QUICK_FILES)."""

import json
import math
import os
import subprocess
import sys

import numpy as np
from helpers import PARITY, ROOT, torchrun

STEPS = ["training.steps=3", "training.eval_every=0"]


def read(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def test_custom_loop_matches_launch_sh(tmp_path):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 256, 4000).astype(np.int64))
    mesh = ["parallelism.dp=2", "parallelism.tp=2"]
    torchrun(4, ["examples/custom_loop.py", PARITY, str(tokens), str(tmp_path / "mine.jsonl"), *mesh, *STEPS])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHON=sys.executable)
    data = ["data.kind=tokens", f"data.path={tokens}", f"logging.run_dir={tmp_path / 'run'}"]
    cmd = ["bash", "launch.sh", PARITY, *mesh, *STEPS, *data]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    mine, theirs = read(tmp_path / "mine.jsonl"), read(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in mine] == [r["step"] for r in theirs] == [1, 2, 3]
    for a, b in zip(mine, theirs):
        for key in ("loss", "grad_norm", "lr"):
            assert math.isclose(a[key], b[key], rel_tol=1e-6), (a["step"], key, a[key], b[key])


def test_custom_model_with_a_tp_plan_matches_one_process(tmp_path):
    torchrun(1, ["examples/custom_model.py", "1", "1", str(tmp_path / "one.jsonl")])
    torchrun(4, ["examples/custom_model.py", "2", "2", str(tmp_path / "dp2tp2.jsonl")])
    one, four = read(tmp_path / "one.jsonl"), read(tmp_path / "dp2tp2.jsonl")
    assert len(one) == len(four) == 4
    for a, b in zip(one, four):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-6), (a, b)
