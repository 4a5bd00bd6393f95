"""Expert FLOPs per rank under tensor parallelism, counted on real training steps.

    python bench/tp_expert_flops.py [--tp 2] [--tree DIR] [--mode ALL_REDUCE]

Trains tests/recipes/moe_parity.yaml (4 MoE layers, 8 experts, top-2, hidden 64, expert
width 128, fp32) for one step at tp (x 1 elsewhere) on CPU ranks with the package from
`--tree` (default: this checkout; give another checkout, e.g. one before the tp token split,
to compare), counting the token rows every rank's experts compute (a wrapper around
models.moe.Experts.forward). Expert FLOPs: rows x 3 matmuls x 2 x hidden x width forward,
x 3 with backward.
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = r"""
import json, os, sys, torch, torch.distributed as dist
from dtensor3d.models import moe
rows = [0]
real = moe.Experts.forward
def counting(self, x, counts):
    rows[0] += x.shape[0]
    return real(self, x, counts)
moe.Experts.forward = counting
from dtensor3d.config.load import load_recipe
from dtensor3d.training.train import setup, train_step, rank_batch
from dtensor3d.datasets.sources import make_source
recipe = load_recipe(sys.argv[1], sys.argv[2:], world_size=int(os.environ["WORLD_SIZE"]))
state = setup(recipe)
train_step(state, rank_batch(state, make_source(recipe), 0))
got = [None] * dist.get_world_size()
dist.all_gather_object(got, rows[0])
if dist.get_rank() == 0:
    print("RESULT " + json.dumps({"rows": got, "package": moe.__file__}), flush=True)
dist.destroy_process_group()
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--mode", default="ALL_REDUCE", choices=("ALL_REDUCE", "REDUCE_SCATTER"))
    ap.add_argument("--tree", default=ROOT)
    args = ap.parse_args()
    recipe = os.path.join(ROOT, "tests", "recipes", "moe_parity.yaml")
    overrides = [f"parallelism.tp={args.tp}", f"parallelism.tp_mode={args.mode}", "training.steps=1"]
    overrides += ["training.micro_batch_size=2", "training.eval_every=0"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.tp}"]
    cmd += ["--no-python", sys.executable, "-c", PROBE, recipe, *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.abspath(args.tree))
    out = subprocess.run(cmd, cwd=args.tree, capture_output=True, text=True, env=env)  # -c imports from the cwd
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        sys.exit(out.stderr[-3000:])
    result = json.loads(line[len("RESULT ") :])
    rows = result["rows"]
    per_row = 3 * 3 * 2 * 64 * 128  # forward + backward (x3) of three 64x128 matmuls
    print(f"{result['package']} tp={args.tp} {args.mode}: 8 sequences x 32 tokens x top-2 x 4 MoE layers per step")
    print("rank  expert rows  expert GFLOP")
    for r, n in enumerate(rows):
        print(f"{r:>4}  {n:>11,}  {n * per_row / 1e9:>12.3f}")


if __name__ == "__main__":
    main()
