"""Muon against AdamW on real text: Python's standard library, the README's text.yaml model
(3.1M parameters, vocab 4,096), each optimizer at its best of 3 peak learning rates.

Prints (one table each): the validation loss at every evaluation of each run; per optimizer
its best run's final validation loss and the steps it took to reach AdamW's best final
validation loss; Muon's step time against AdamW's at dp 2 and at tp 2 (median over the
steps after the first 5); and the bytes `plan` counts for Muon's owner exchange.

The sweep runs at world 1 (the numbers are the same at any mesh: the parity tests), shorter
than text.yaml's 400 steps (60 by default).
Muon's runs keep AdamW's lr (text.yaml's) for the embedding, head and norms and sweep
optimizer.muon_lr (torch's default lr adjustment, "original").

usage: python bench/muon.py [--steps 60] [--data DIR] [--overhead-only]   (DIR: a prepared
stdlib directory; default: prepared here into a temporary directory. --overhead-only: the step
time and byte tables alone, for a rerun on a quiet machine)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "text.yaml")
ADAMW_LRS = (1e-3, 3e-3, 1e-2)
MUON_LRS = (0.01, 0.02, 0.05)


def prepare(out: str) -> str:
    stdlib = sysconfig.get_paths()["stdlib"]
    cmd = [sys.executable, "-m", "dtensor3d", "prepare-data", f"{stdlib}/**/*.py", "--exclude", "*/site-packages/*"]
    cmd += ["--out", out, "--train-tokenizer", "4096", "--val-fraction", "0.01"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    return out


def train(nproc: int, overrides: list[str]) -> list[dict]:
    run_dir = tempfile.mkdtemp(prefix="bench-muon-")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += ["-m", "dtensor3d", "train", RECIPE, f"logging.run_dir={run_dir}", "checkpoint.dir=", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=env)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def sweep(data: str, steps: int) -> dict[str, list[dict]]:
    common = [f"data.path={data}", f"training.steps={steps}", "training.eval_every=20", "parallelism.dp=1"]
    common += ["logging.every=1", "optimizer.warmup_steps=10"]
    runs = {}
    jobs = [(f"adamw lr {lr:g}", [f"optimizer.lr={lr}"]) for lr in ADAMW_LRS]
    jobs += [(f"muon muon_lr {lr:g}", ["optimizer.name=muon", f"optimizer.muon_lr={lr}"]) for lr in MUON_LRS]
    for name, extra in jobs:
        runs[name] = train(1, [*common, *extra])
        print(f"| {name} | " + " | ".join(f"@{s} {v:.3f}" for s, v in val(runs[name])) + " |", flush=True)
    return runs


def val(records: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]


def step_seconds(records: list[dict]) -> float:
    tokens = 8 * 256  # text.yaml's global batch x sequence length
    return statistics.median(tokens / r["tokens_per_sec"] for r in records[5:] if r.get("tokens_per_sec"))


def overhead(data: str) -> list[str]:
    rows = []
    for mesh in (["parallelism.dp=2"], ["parallelism.dp=1", "parallelism.tp=2"]):
        common = [f"data.path={data}", "training.steps=25", "training.eval_every=0", "logging.every=1", *mesh]
        adamw, muon = (step_seconds(train(2, [*common, *extra])) for extra in ([], ["optimizer.name=muon"]))
        rows.append(f"| {' '.join(m.split('.')[1] for m in mesh)} | {adamw * 1e3:.0f} ms | {muon * 1e3:.0f} ms | "
                    f"{muon / adamw:.2f} |")  # fmt: skip
    return rows


def plan_bytes() -> list[str]:
    from dtensor3d.config.load import load_recipe
    from dtensor3d.plan.muon_cost import muon_stage

    rows = []
    for mesh in (["parallelism.dp=2"], ["parallelism.dp=1", "parallelism.tp=2"]):
        s = muon_stage(load_recipe(RECIPE, ["optimizer.name=muon", *mesh]))[0]
        rows.append(
            f"| {' '.join(mesh)} | {s['matrices']} | {s['sent_bytes'] / 2:,.0f} B | {s['owner_bytes']:,.0f} B |"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--data")
    ap.add_argument("--overhead-only", action="store_true", help="skip the sweep: step times and bytes only")
    args = ap.parse_args()
    data = args.data or prepare(os.path.join(tempfile.mkdtemp(prefix="bench-stdlib-"), "stdlib"))
    if not args.overhead_only:
        compare(data, args.steps)
    print(f"\n(load average before the step times: {os.getloadavg()[0]:.1f})")
    print("\n| mesh | AdamW step | Muon step | ratio |\n|---|---|---|---|")
    print("\n".join(overhead(data)), flush=True)
    print(
        "\n| mesh | Muon matrices | sent per rank per step (mean) | owner's bf16 matrices (mean) |\n|---|---|---|---|"
    )
    print("\n".join(plan_bytes()))


def compare(data: str, steps: int) -> None:
    """The sweep, its validation-loss table and each optimizer's best run."""
    print("each run's validation loss as it finishes:", flush=True)
    runs = sweep(data, steps)
    evals = [s for s, _ in val(next(iter(runs.values())))]
    print("| run | " + " | ".join(f"val @{s}" for s in evals) + " |")
    print("|---|" + "---|" * len(evals))
    for name, records in runs.items():
        print(f"| {name} | " + " | ".join(f"{v:.3f}" for _, v in val(records)) + " |")
    best = {k: min((n for n in runs if n.startswith(k)), key=lambda n: val(runs[n])[-1][1]) for k in ("adamw", "muon")}
    target = val(runs[best["adamw"]])[-1][1]
    print(f"\n| optimizer | best run | final val | steps to AdamW's final val {target:.3f} |\n|---|---|---|---|")
    for k, n in best.items():
        reach = next((s for s, v in val(runs[n]) if v <= target), None)
        print(f"| {k} | {n} | {val(runs[n])[-1][1]:.3f} | {reach if reach is not None else 'not reached'} |")


if __name__ == "__main__":
    main()
