"""How accurate is `plan`'s estimate? Train small meshes on CPU and print estimate against
measurement.

    python bench/plan_accuracy.py [--only NAME ...]

Each mesh below trains the tiny model of tests/recipes/parity.yaml (or moe_parity.yaml)
for two steps on <= 4 CPU ranks (torchrun, gloo, OMP_NUM_THREADS=1); bench/accuracy_rank.py
measures step 2 on every rank. Printed per mesh:

- memory, per pipeline stage: parameters, parameter / gradient / AdamW bytes (the rank of
  the stage with dp = cp = ep = 0, which holds FSDP2's largest chunks), and the peak of live
  tensor bytes during step 2 (the most any rank of the stage reached; bench/live_bytes.py)
  against the estimate's `peak_bytes`;
- communication: for every rank, the bytes handed to each collective kind per mesh dim
  against the estimate of its stage ("exact" when every rank's every figure is equal; the
  expert all-to-alls are routing-dependent and the estimate is their expectation under
  uniform routing, so the ep line shows the measured range);
- under pp: the estimate's bubble fraction for the schedule (dtensor3d/schedule_model.py:
  (p - 1) / (m + p - 1) for 1f1b and afab, (p - 1) / (v m + p - 1) interleaved, ...) against
  each pp rank's measured idle share of the schedule's step (1 - compute time / step wall time).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dtensor3d.config.load import load_recipe  # noqa: E402
from dtensor3d.plan.estimate import estimate  # noqa: E402
from dtensor3d.plan.params import KINDS  # noqa: E402

DENSE, MOE = "tests/recipes/parity.yaml", "tests/recipes/moe_parity.yaml"
MESHES = {
    "dp2 fsdp": (DENSE, ["parallelism.dp=2"]),
    "tp2 sp x dp2 fsdp": (DENSE, ["parallelism.tp=2", "parallelism.dp=2", "parallelism.tp_mode=REDUCE_SCATTER"]),
    "tp2 x dp2 replicate": (DENSE, ["parallelism.tp=2", "parallelism.dp=2", "parallelism.dp_mode=replicate"]),
    "pp2 x dp2 fsdp": (DENSE, ["parallelism.pp=2", "parallelism.dp=2"]),
    "pp4 1f1b": (DENSE, ["parallelism.pp=4"]),
    "pp2 afab x tp2": (DENSE, ["parallelism.pp=2", "parallelism.tp=2", "parallelism.pp_engine=afab"]),
    "cp2 x dp2 recompute": (DENSE, ["parallelism.cp=2", "parallelism.dp=2", "parallelism.recompute_layer=true"]),
    "ep2 x dp2 fsdp (moe)": (MOE, ["parallelism.ep=2", "parallelism.dp=2"]),
    "ep2 x tp2 (moe)": (MOE, ["parallelism.ep=2", "parallelism.tp=2"]),
    "dp2 selective": (DENSE, ["parallelism.dp=2", "parallelism.recompute=selective"]),
    "cp2 x tp2 sp selective": (
        DENSE,
        [
            "parallelism.cp=2",
            "parallelism.tp=2",
            "parallelism.tp_mode=REDUCE_SCATTER",
            "parallelism.recompute=selective",
        ],
    ),
    "pp2 interleaved x dp2": (
        DENSE,
        ["parallelism.pp=2", "parallelism.pp_engine=interleaved_1f1b", "parallelism.dp=2"],
    ),
    "pp2 zbv x tp2": (DENSE, ["parallelism.pp=2", "parallelism.pp_engine=zbv", "parallelism.tp=2"]),
    "pp2 dualpipev": (DENSE, ["parallelism.pp=2", "parallelism.pp_engine=dualpipev"]),
    "pp2 zbv full": (DENSE, ["parallelism.pp=2", "parallelism.pp_engine=zbv", "parallelism.recompute=full"]),
    "pp2 interl. selective": (
        DENSE,
        ["parallelism.pp=2", "parallelism.pp_engine=interleaved_1f1b", "parallelism.recompute=selective"],
    ),
}
MIB = 2**20


def measure(path: str, overrides: list[str], world: int) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "bench"), ROOT, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    cmd += [os.path.join(ROOT, "bench", "accuracy_rank.py"), path, *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    # ranks print concurrently: decode from each marker
    ranks = [json.JSONDecoder().raw_decode(piece)[0] for piece in proc.stdout.split("ACCURACY ")[1:]]
    return sorted(ranks, key=lambda r: r["rank"])


def expected_comm(stage_comm: dict, measured_dims) -> dict[str, dict[str, int]]:
    """The estimate per measured dim; a dim named "a+b" (two dims sharing one process
    group) expects the sum of both."""
    out, merged = {}, {d for dim in measured_dims for d in dim.split("+")}
    for dim in set(measured_dims) | {d for d, kinds in stage_comm.items() if kinds["total"] and d not in merged}:
        kinds = {k: sum(stage_comm[d][k] for d in dim.split("+")) for k in KINDS}
        out[dim] = {k: n for k, n in kinds.items() if n}
    return {d: k for d, k in out.items() if k}


def memory_lines(name: str, est: dict, ranks: list[dict]) -> list[str]:
    lines = []
    for row in est["stages"]:
        mine = [r for r in ranks if r["coords"]["pp"] == row["stage"]]
        first = next(r for r in mine if r["coords"]["dp"] == r["coords"]["cp"] == r["coords"]["ep"] == 0)
        exact = all(first[k] == row[k] for k in ("params", "param_bytes", "grad_bytes", "optimizer_bytes"))
        peak = max(r["peak"] for r in mine)
        lines.append(
            f"{name:<22} {row['stage']:>5} {row['params']:>9,} {first['params']:>9,} "
            f"{row['param_bytes']:>10,} {row['grad_bytes']:>10,} {row['optimizer_bytes']:>10,} "
            f"{'exact' if exact else 'DIFFERS':>7} {row['peak_bytes'] / MIB:>9.3f} {peak / MIB:>9.3f} "
            f"{100 * (row['peak_bytes'] - peak) / peak:>+6.1f}%"
        )
    return lines


def comm_lines(name: str, est: dict, ranks: list[dict]) -> list[str]:
    """Per dim: every rank against its stage's estimate; the busiest rank's total shown."""
    by_dim: dict[str, dict] = {}
    for r in ranks:
        want = expected_comm(est["stages"][r["coords"]["pp"]]["comm_bytes_per_step"], r["comm"])
        for dim in set(want) | set(r["comm"]):
            got, exp = r["comm"].get(dim, {}), want.get(dim, {})
            d = by_dim.setdefault(dim, {"exact": True, "est": 0, "got": [], "kinds": set()})
            d["exact"] &= got == exp
            d["est"] = max(d["est"], sum(exp.values()))
            d["got"].append(sum(got.values()))
            d["kinds"] |= set(got) | set(exp)
    lines = []
    for dim, d in sorted(by_dim.items()):
        got = f"{max(d['got']):,}" if min(d["got"]) == max(d["got"]) else f"{min(d['got']):,}..{max(d['got']):,}"
        verdict = "exact" if d["exact"] else ("expected" if dim == "ep" else "DIFFERS")
        kinds = ", ".join(sorted(d["kinds"]))
        lines.append(f"{name:<22} {dim:>6} {d['est']:>12,} {got:>21} {verdict:>8}  {kinds}")
    return lines


def bubble_lines(name: str, est: dict, ranks: list[dict]) -> list[str]:
    if "stage_busy_s" not in ranks[0]:
        return []
    idle = {}
    for r in ranks:
        idle.setdefault(r["coords"]["pp"], []).append(1 - r["stage_busy_s"] / r["step_wall_s"])
    stages = " ".join(f"{sum(v) / len(v):.3f}" for _, v in sorted(idle.items()))
    mean = sum(sum(v) / len(v) for v in idle.values()) / len(idle)
    return [f"{name:<22} {est['bubble_fraction']:>9.3f} {mean:>9.3f}   {stages}"]


HEADERS = {
    "memory": f"{'mesh':<22} {'stage':>5} {'params':>9} {'measured':>9} {'param B':>10} {'grad B':>10} "
    f"{'AdamW B':>10} {'p/g/o':>7} {'peak MiB':>9} {'measured':>9} {'diff':>7}",
    "comm": f"{'mesh':<22} {'dim':>6} {'est B/rank':>12} {'measured B/rank':>21} {'verdict':>8}  kinds",
    "bubble": f"{'mesh':<22} {'bubble':>9} {'idle':>9}   idle per stage",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", default=None, help="mesh names to run (default: all)")
    ap.add_argument("--save", default=None, help="also write the measurements to this JSON file")
    ap.add_argument("--load", default=None, help="print against measurements saved by --save (no training)")
    args = ap.parse_args()
    saved = json.load(open(args.load)) if args.load else {}
    out, measured = {key: [] for key in HEADERS}, {}
    for name, (path, overrides) in MESHES.items():
        if (args.only and name not in args.only) or (args.load and name not in saved):
            continue
        recipe = load_recipe(os.path.join(ROOT, path), overrides)
        est = estimate(recipe, backend="gloo")
        ranks = measured[name] = saved.get(name) or measure(path, overrides, recipe.parallelism.world_size)
        out["memory"] += memory_lines(name, est, ranks)
        out["comm"] += comm_lines(name, est, ranks)
        out["bubble"] += bubble_lines(name, est, ranks)
        print(f"measured {name}", file=sys.stderr, flush=True)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(measured, f)
    print("tiny models of tests/recipes/parity.yaml / moe_parity.yaml, fp32, CPU (gloo), step 2 of 2")
    for key, lines in out.items():
        print("\n" + HEADERS[key])
        print("\n".join(lines))


if __name__ == "__main__":
    main()
