"""Peak memory per rank while a checkpoint is saved and while it is loaded, against the
rank's own state (its parameters and AdamW state), for a ~100M-parameter Llama on CPU.

    python bench/checkpoint_memory.py [--mesh dp4 tp2pp2] [--threads 1]

Each phase runs in a fresh torchrun job of 4 ranks. What is measured is the resident set
(RSS, Linux /proc/self/status), above the process's RSS once torch and dtensor3d are
imported and nothing is built. Right before the phase the rank frees what it can
(gc, malloc_trim), resets its high-water mark (`echo 5 > /proc/self/clear_refs`), runs the
phase, and reads VmHWM. RSS sees everything torch allocates on the CPU and the pages of any
file mapping the phase touches (safetensors' mmap), which tracemalloc would not.

- save: setup, one optimizer step on zero gradients (so the AdamW state exists), then the
  training loop's Saver writes a checkpoint.
- load: setup (fresh weights, no optimizer state), then `resume` from that checkpoint; the
  peak includes the optimizer state the load creates, which is part of the rank's state.

Per rank it reports: state_mb (own parameters + optimizer state), before_mb (RSS above that
base right before the phase), peak_mb (the phase's high-water mark above the same base),
extra_mb (peak - RSS right before the phase) and the goal: peak <= 1.2 x state + the largest
single full tensor.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = [  # ~100.5M parameters: 2 x 32000 x 640 embeddings/head + 12 x 4.96M
    "model.vocab_size=32000",
    "model.hidden_size=640",
    "model.intermediate_size=1728",
    "model.num_hidden_layers=12",
    "model.num_attention_heads=10",
    "model.num_key_value_heads=10",
    "training.steps=1",
    "training.eval_every=0",
]
MESHES = {"dp4": ["parallelism.dp=4"], "tp2pp2": ["parallelism.tp=2", "parallelism.pp=2"]}

PROBE = r"""
import ctypes, gc, json, os, sys
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def rss(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def settle():
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def local_bytes(t):
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


from dtensor3d.config.load import load_recipe
from dtensor3d.training.train import setup
from dtensor3d.checkpoint.background import Saver
from dtensor3d.checkpoint.resume import resume

settle()
base = rss("VmRSS")  # the runtime: Python, torch and dtensor3d imported, nothing built

phase, path, recipe_path, *overrides = sys.argv[1:]
recipe = load_recipe(recipe_path, overrides, world_size=int(os.environ["WORLD_SIZE"]))
state = setup(recipe)
if phase == "save":
    for p in state.model.parameters():
        p.grad = torch.zeros_like(p)
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.step = 1
    run = lambda: Saver(state).save(state)
else:
    run = lambda: resume(state, path)
settle()
before = rss("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
run()
peak = rss("VmHWM")
dist.barrier()
params = list(state.model.parameters())
own = sum(local_bytes(p) for p in params)
own += sum(local_bytes(v) for p in params for v in state.optimizer.state.get(p, {}).values())
largest = max(p.numel() * p.element_size() for p in params)
row = dict(rank=dist.get_rank(), state=own, before=before - base, peak=peak - base, extra=peak - before,
           largest=largest)
sys.stdout.write("ROW " + json.dumps(row) + "\n")
sys.stdout.flush()
dist.destroy_process_group()
"""


def phase(name: str, mesh: list[str], path: str, threads: int) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=ROOT)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(PROBE)
    recipe = os.path.join(ROOT, "tests/recipes/parity.yaml")
    extra = [f"checkpoint.dir={path}"] if name == "save" else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", f.name, name, path]
    cmd += [recipe, *MODEL, *mesh, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    os.unlink(f.name)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = [json.loads(line[4:]) for line in proc.stdout.replace("ROW ", "\nROW ").splitlines() if line[:4] == "ROW "]
    return sorted(rows, key=lambda r: r["rank"])


def report(mesh: str, name: str, rows: list[dict]) -> None:
    mb = 1 / 2**20
    for r in rows:
        goal = 1.2 * r["state"] + r["largest"]
        print(
            f"| {mesh} | {name} | {r['rank']} | {r['state'] * mb:.0f} | {r['before'] * mb:.0f} | "
            f"{r['peak'] * mb:.0f} | {r['extra'] * mb:.0f} | {r['peak'] / r['state']:.2f} | "
            f"{'yes' if r['peak'] <= goal else 'NO'} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mesh", nargs="+", default=list(MESHES), choices=list(MESHES))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    print("| mesh | phase | rank | state MB | RSS before MB | peak MB | extra MB | peak/state | goal met |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mesh in args.mesh:
        with tempfile.TemporaryDirectory() as ckpt:
            report(mesh, "save", phase("save", MESHES[mesh], ckpt, args.threads))
            step = os.path.join(ckpt, "step_00000001")
            report(mesh, "load", phase("load", MESHES[mesh], step, args.threads))


if __name__ == "__main__":
    main()
