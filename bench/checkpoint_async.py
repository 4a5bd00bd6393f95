"""Step time around a checkpoint save, with checkpoint.async off and on.

    python bench/checkpoint_async.py [--hidden 512] [--layers 4] [--steps 12] [--interval 4]

One CPU process trains the parity model widened to --hidden, saving every --interval steps
into a temporary directory, once with synchronous saves and once with checkpoint.async.
For each it prints the mean wall time of a step that saves (the step plus the time the loop
is held by the save) and of the steps that do not (with async these run while the
background write is in flight), in ms; the first two steps (warm-up) are left out.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = r"""
import json, sys, time
import torch.distributed as dist
from dtensor3d.config.load import load_recipe
from dtensor3d.training.train import setup, train_step, rank_batch
from dtensor3d.datasets.sources import make_source
from dtensor3d.checkpoint import checkpoint_due
from dtensor3d.checkpoint.background import Saver
recipe = load_recipe(sys.argv[1], sys.argv[2:], world_size=1)
state = setup(recipe)
source, saver, rows = make_source(recipe), Saver(state), []
for step in range(recipe.training.steps):
    start = time.perf_counter()
    train_step(state, rank_batch(state, source, step))
    saves = checkpoint_due(recipe, state.step)
    if saves:
        saver.save(state)
    rows.append({"step": state.step, "ms": 1000 * (time.perf_counter() - start), "saves": saves})
saver.wait()
dist.destroy_process_group()
print("ROWS " + json.dumps(rows))
"""


def run(args, async_save: bool, ckpt: str) -> dict:
    overrides = [
        f"model.hidden_size={args.hidden}",
        f"model.intermediate_size={args.hidden * 2}",
        f"model.num_hidden_layers={args.layers}",
        f"training.steps={args.steps}",
        "training.eval_every=0",
        f"checkpoint.dir={ckpt}",
        f"checkpoint.interval={args.interval}",
        f"checkpoint.async={str(async_save).lower()}",
        "checkpoint.keep=1",
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    cmd = [sys.executable, "-c", PROBE, os.path.join(ROOT, "tests/recipes/parity.yaml"), *overrides]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    rows = json.loads(next(line for line in out.splitlines() if line.startswith("ROWS "))[5:])[2:]
    saving = [r["ms"] for r in rows if r["saves"]]
    other = [r["ms"] for r in rows if not r["saves"]]
    return {"async": async_save, "save_step_ms": sum(saving) / len(saving), "other_step_ms": sum(other) / len(other)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--interval", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    for async_save in (False, True):
        with tempfile.TemporaryDirectory() as ckpt:
            print(json.dumps(run(args, async_save, ckpt)), flush=True)


if __name__ == "__main__":
    main()
