"""All-to-all traffic of expert parallelism, measured against the routed tokens.

    python bench/ep_bytes.py [--ep 2] [--steps 3]

Trains recipes/moe.yaml at ep (x dp 1) for a few steps on CPU ranks with every
`all_to_all_single` call counted (bytes each rank sends, its own share included), and
prints, per step, the measured bytes next to routed slots x hidden x element size x 4
(dispatch and combine in forward, the same two in backward) and the split-size exchange.
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = r"""
import json, os, sys, torch, torch.distributed as dist
counted = {"token_bytes": 0, "count_bytes": 0}
real = dist.all_to_all_single
def counting(output, input, *args, **kwargs):
    key = "count_bytes" if input.dtype == torch.int64 else "token_bytes"
    counted[key] += input.numel() * input.element_size()
    return real(output, input, *args, **kwargs)
dist.all_to_all_single = counting  # torch.distributed.nn.functional calls it through the module
from dtensor3d.config.load import load_recipe
from dtensor3d.training.train import setup, train_step, rank_batch
from dtensor3d.datasets.sources import make_source
recipe = load_recipe(sys.argv[1], sys.argv[2:], world_size=int(os.environ["WORLD_SIZE"]))
state = setup(recipe)
source = make_source(recipe)
rows = []
for step in range(recipe.training.steps):
    before = dict(counted)
    metrics = train_step(state, rank_batch(state, source, step))
    sent = torch.tensor([counted[k] - before[k] for k in ("token_bytes", "count_bytes")], dtype=torch.float64)
    dist.all_reduce(sent)
    rows.append({"step": step + 1, "token_bytes": sent[0].item(), "count_bytes": sent[1].item(),
                 "routed_slots": sum(metrics["tokens_per_expert"])})
if dist.get_rank() == 0:
    print("RESULT " + json.dumps(rows), flush=True)
dist.destroy_process_group()
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    recipe = os.path.join(ROOT, "recipes", "moe.yaml")
    overrides = [f"parallelism.ep={args.ep}", "parallelism.dp=1", f"training.steps={args.steps}", "training.device=cpu"]
    sys.path.insert(0, ROOT)
    from dtensor3d.config.load import load_recipe

    r = load_recipe(recipe, overrides)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.ep}",
        "--no-python",
        sys.executable,
        "-c",
        PROBE,
        recipe,
        *overrides,
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        sys.exit(out.stderr[-3000:])
    h, elem = r.model.hidden_size, 4
    print(
        f"recipes/moe.yaml at ep={args.ep}: hidden {h}, fp32, top-{r.model.num_experts_per_tok}, "
        f"{r.model.num_hidden_layers} MoE layers; bytes summed over ranks"
    )
    print(
        f"{'step':>4} {'routed slots':>12} {'all-to-all token bytes':>23} {'slots*h*4B*4':>13} "
        f"{'ratio':>6} {'split-size bytes':>17}"
    )
    for row in json.loads(line[7:]):
        expected = row["routed_slots"] * h * elem * 4
        print(
            f"{row['step']:>4} {row['routed_slots']:>12} {row['token_bytes']:>23,.0f} {expected:>13,} "
            f"{row['token_bytes'] / expected:>6.3f} {row['count_bytes']:>17,.0f}"
        )


if __name__ == "__main__":
    main()
