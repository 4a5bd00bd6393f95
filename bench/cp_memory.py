"""Per-rank activation memory and attention work under context parallelism.

    python bench/cp_memory.py [--seq 4096] [--cps 1 2 4] [--kernel auto|flash|masked]

For each cp size it launches `cp` CPU ranks (torchrun), builds the model of
tests/recipes/parity.yaml at the given sequence length, runs one microbatch forward and
sums the bytes autograd saves for backward (each storage once) on every rank. It prints
the per-rank figure, its ratio to cp=1, and the max/min causal (query, key) pairs per rank.
--kernel forces cp_attention's kernel at cp > 1 (default: cp_kernel's choice for the
device); cp=1 always runs the model's own causal attention.
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = r"""
import json, os, sys, torch, torch.distributed as dist
from dtensor3d.config.load import load_recipe
from dtensor3d.training.train import setup, rank_batch
from dtensor3d.datasets.sources import make_source
kernel = sys.argv[1]
recipe = load_recipe(sys.argv[2], sys.argv[3:], world_size=int(os.environ["WORLD_SIZE"]))
state = setup(recipe)
if kernel != "auto" and recipe.parallelism.cp > 1:
    from dtensor3d.parallel import context
    context.cp_kernel = lambda device: kernel  # force the kernel (cp_attention asks cp_kernel)
inputs, targets = rank_batch(state, make_source(recipe), 0)
mbs = recipe.training.micro_batch_size
seen = {}
def pack(t):
    s = t.untyped_storage()
    seen[s.data_ptr()] = s.nbytes()
    return t
with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    loss = state.loss_fn(state.model(inputs[:mbs]), targets[:mbs])
mine = torch.tensor([float(sum(seen.values()))])
every = [torch.zeros(1) for _ in range(dist.get_world_size())]
dist.all_gather(every, mine)
if dist.get_rank() == 0:
    print("RESULT " + json.dumps([t.item() for t in every]), flush=True)
dist.destroy_process_group()
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--kernel", choices=["auto", "flash", "masked"], default="auto")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    import torch

    from dtensor3d.parallel.context import attention_pairs, cp_kernel

    kernel = cp_kernel(torch.device("cpu")) if args.kernel == "auto" else args.kernel

    recipe = os.path.join(ROOT, "tests", "recipes", "parity.yaml")
    rows = []
    for cp in args.cps:
        overrides = [
            f"parallelism.cp={cp}",
            f"training.sequence_length={args.seq}",
            f"model.max_position_embeddings={args.seq}",
            "training.global_batch_size=1",
        ]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={cp}",
            "--no-python",
            sys.executable,
            "-c",
            PROBE,
            args.kernel,
            recipe,
            *overrides,
        ]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"cp={cp} failed:\n{out.stderr[-3000:]}")
        per_rank = json.loads(line[7:])
        pairs = attention_pairs(args.seq, cp)
        rows.append((cp, max(per_rank), min(per_rank), max(pairs) / min(pairs)))
        print(f"cp={cp} done", file=sys.stderr, flush=True)
    base = rows[0][1]
    print(
        f"sequence {args.seq}, model tests/recipes/parity.yaml, one sequence per microbatch, fp32, cp kernel {kernel}"
    )
    print(f"{'cp':>3} {'activations/rank MiB (max)':>28} {'min':>8} {'vs cp=1':>8} {'attn pairs max/min':>19}")
    for cp, hi, lo, bal in rows:
        print(f"{cp:>3} {hi / 2**20:>28.1f} {lo / 2**20:>8.1f} {hi / base:>8.3f} {bal:>19.3f}")


if __name__ == "__main__":
    main()
