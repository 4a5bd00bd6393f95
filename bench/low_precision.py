"""Low precision against bf16 on real text (issue 41): the README's text model
(recipes/text.yaml) on Python's standard library, world 1, the same seed and batches:
bf16 / float8 tensorwise / float8 rowwise (training.float8). Prints a table (first-step loss
relative to bf16's, mean |delta loss| over the last 50 steps as a fraction of bf16's loss, the
last loss, seconds per step) and writes one loss.svg overlay of every curve.

    python bench/low_precision.py --steps 200 --svg docs/assets/low_precision_loss.svg   # at SHAPE's lr 1.5e-3
    python bench/low_precision.py --probe 22 --runs "bf16,float8 tensorwise"   # steps 21-22 recorded

--data DIR: a prepared directory (prepare-data; README's stdlib recipe); without it, one is
prepared from the standard library's top-level modules (a 4096-token BPE trained on them).

Each run uses one thread (OMP_NUM_THREADS=1 unless set): on a shared 2-core box two OpenMP
threads wait on each other whenever another process holds a core -- a text-model step that
takes 0.2 s on a quiet box took 10-56 s at a load of 20 with two threads."""

import argparse
import glob
import json
import os
import subprocess
import sys
import sysconfig
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import ROOT  # noqa: E402

RUNS = {
    "bf16": [],
    "fp32": ["training.dtype=float32"],  # how far bf16 itself is from full precision
    "float8 tensorwise": ["training.float8={recipe: tensorwise}"],
    "float8 rowwise": ["training.float8={recipe: rowwise}"],
    "state bf16": ["optimizer.state_dtype=bfloat16"],  # AdamW's moments in bf16 (optimizer.state_dtype)
    "state 8bit": ["optimizer.state_dtype=8bit"],  # torchao's block-wise 8-bit AdamW
}  # a run the door refuses (a state_dtype not built yet) prints "not run" and its error line
# The bench's peak lr, half the recipe's 3e-3: at 3e-3 on the full standard library every run spikes
# after its warmup (step 22: one window-first token's gradient) and float8 runs part from bf16 there.
# Chosen on bf16 runs alone, before any float8 run at it (docs/benchmarks.md has both lrs' figures);
# `--shape optimizer.lr=3e-3` gives the recipe's back.
SHAPE = ["optimizer.lr=1.5e-3"]
ONE_THREAD = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))  # see the module's doc


def prepare(folder: str) -> str:
    """The standard library's top-level .py files, prepared with a 4096-token BPE."""
    out = os.path.join(folder, "stdlib")
    stdlib = sysconfig.get_paths()["stdlib"]
    args = ["prepare-data", os.path.join(stdlib, "*.py"), "--out", out, "--train-tokenizer", "4096"]
    subprocess.run([sys.executable, "-m", "dtensor3d", *args, "--val-fraction", "0.01"], check=True, cwd=ROOT)
    return out


def overrides(name: str, extra: list[str], data: str, steps: int, folder: str, shape: list[str]) -> list[str]:
    """The train command's overrides of one world-1 run (its run_dir: folder/<name>)."""
    run_dir = os.path.join(folder, name.replace(" ", "_"))
    given = [f"training.steps={steps}", "parallelism.dp=1", "training.device=cpu"]
    given += [] if any(e.startswith("training.dtype=") for e in extra) else ["training.dtype=bfloat16"]
    given += [f"data.path={data}", "checkpoint.dir=null", f"logging.run_dir={run_dir}", "logging.every=1"]
    return [*given, "training.eval_every=0", *shape, *extra]


def train(name: str, extra: list[str], data: str, steps: int, folder: str, shape: list[str]) -> tuple[list, float]:
    """(the [step, loss] pairs, median seconds per step after the first) of one world-1 run."""
    run_dir = os.path.join(folder, name.replace(" ", "_"))
    given = overrides(name, extra, data, steps, folder, shape)
    command = [sys.executable, "-m", "dtensor3d", "train", "recipes/text.yaml", *given]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=ONE_THREAD)
    if proc.returncode:
        print(f"{name}: not run ({proc.stderr.strip().splitlines()[-1]})")
        return [], 0.0
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl")) if '"loss"' in x]
    times = sorted(r["ms_per_step"] for r in rows[1:] or rows)  # the first step warms up
    return [(r["step"], r["loss"]) for r in rows], times[len(times) // 2] / 1000  # the median step


def probe(names: list[str], data: str, steps: int, folder: str, shape: list[str], at: int) -> None:
    """--probe STEP: each run again, on the same schedule, up to step STEP, in a child process
    that records steps STEP-1 and STEP (probe_child); prints what it recorded."""
    for name in names:
        given = overrides(name, RUNS[name], data, steps, os.path.join(folder, "probe"), shape)
        out = os.path.join(folder, name.replace(" ", "_") + "-probe.json")
        command = [sys.executable, os.path.abspath(__file__), "--child-probe", str(at), out, *given]
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=ONE_THREAD)
        if not os.path.exists(out):
            print(f"{name}: probe failed ({(proc.stderr.strip().splitlines() or ['no output'])[-1]})")
            continue
        for row in json.load(open(out)):
            grads = ", ".join(f"{n} {v:.3f}" for n, v in row["grads"])
            print(f"{name}, step {row['step']}: loss {row['loss']:.4f}, grad_norm {row['grad_norm']:.3f}")
            print(f"  largest gradient norms (before clipping): {grads}")
            for mb, r, pos, tok, g, g_med, rms, rms_med in row["tokens"]:
                print(
                    f"  microbatch {mb}: largest gradient at block 0's input: row {r}, position {pos}, token {tok}: "
                    f"{g:.2e} (median {g_med:.1e}); its final-norm input rms {rms:.3f} (median {rms_med:.2f})"
                )


def probe_child(at: int, out: str, given: list[str]) -> None:
    """The trainer in this process (text.yaml with `given`), its train_step wrapped at steps at-1
    and at (_recording); writes their records to `out` and ends the process after step `at`
    (os._exit: the rest of the schedule is not needed)."""
    import dtensor3d.training.train as trainer
    from dtensor3d.__main__ import main as cli

    rows, step_fn = [], trainer.train_step

    def wrapped(state, *args, **kwargs):
        if state.step + 1 < at - 1:
            return step_fn(state, *args, **kwargs)
        metrics, row = _recording(state, lambda: step_fn(state, *args, **kwargs))
        rows.append(row)
        if state.step >= at:
            with open(out, "w") as f:
                json.dump(rows, f)
            os._exit(0)
        return metrics

    trainer.train_step = wrapped
    cli(["train", "recipes/text.yaml", *given])


def _recording(state, run) -> tuple[dict, dict]:
    """One train step (`run`) with hooks: each token's gradient norm at the first block's input
    (the embedding's output) and its final-norm input rms, per microbatch (the token with the
    largest gradient), and after the step the six largest parameter gradient norms before
    clipping (the step clipped them in place: times grad_norm / clip_grad where it clipped)."""
    inner, seen = state.model.model, []

    def at_embedding(_module, args, y):
        seen.append({"ids": args[0]})
        entry = seen[-1]
        y.register_hook(lambda g: entry.__setitem__("g", g.float().norm(dim=-1)))

    def at_norm(_module, args, _y):
        seen[-1]["rms"] = args[0].detach().float().pow(2).mean(-1).sqrt()

    hooks = [inner.embed_tokens.register_forward_hook(at_embedding), inner.norm.register_forward_hook(at_norm)]
    try:
        metrics = run()
    finally:
        for hook in hooks:
            hook.remove()
    clip = state.recipe.optimizer.clip_grad
    unclip = max(1.0, metrics["grad_norm"] / clip) if clip else 1.0
    named = [(n, q.grad) for n, q in state.model.named_parameters() if q.grad is not None]
    norms = [(n, g.float().norm().item() * unclip) for n, g in named]
    tokens = []
    for mb, e in enumerate(seen):
        g, rms = e["g"], e["rms"]
        r, pos = divmod(int(g.flatten().argmax()), g.shape[1])
        stats = [g[r, pos].item(), g.median().item(), rms[r, pos].item(), rms.median().item()]
        tokens.append([mb, r, pos, int(e["ids"][r, pos]), *stats])
    grads = sorted(norms, key=lambda x: -x[1])[:6]
    row = {"step": metrics["step"], "loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "grads": grads}
    return metrics, {**row, "tokens": tokens}


def compare(curves: dict, seconds: dict, base: str = "bf16") -> list[str]:
    """The table's rows against `base`."""
    ref = [loss for _, loss in curves.get(base, [])] or [float("nan")]  # the base not run: no comparison
    tail = min(50, len(ref))
    rows = ["| run | step-1 loss | vs bf16, rel | mean abs delta, last 50 steps / loss | last loss | s / step |"]
    rows.append("|---|---|---|---|---|---|")
    for name, pts in curves.items():
        if not pts:
            continue
        losses = [loss for _, loss in pts]
        first = abs(losses[0] - ref[0]) / ref[0]
        mean = sum(abs(a - b) for a, b in zip(losses[-tail:], ref[-tail:])) / tail
        frac = mean / (sum(ref[-tail:]) / tail)
        rows.append(f"| {name} | {losses[0]:.4f} | {first:.1e} | {frac:.2%} | {losses[-1]:.4f} | {seconds[name]:.2f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--data", default=None)
    ap.add_argument("--svg", default=None, help="where to write the loss overlay (default: beside the runs)")
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated names of RUNS")
    ap.add_argument("--shape", nargs="*", default=[], help=f"more overrides for every run (after {' '.join(SHAPE)})")
    ap.add_argument("--probe", type=int, default=None, help="STEP: record steps STEP-1 and STEP of each run instead")
    if sys.argv[1:2] == ["--child-probe"]:  # probe's child: STEP OUT OVERRIDES...
        return probe_child(int(sys.argv[2]), sys.argv[3], sys.argv[4:])
    args = ap.parse_args()
    given = {x.split("=")[0] for x in args.shape}
    args.shape = [x for x in SHAPE if x.split("=")[0] not in given] + args.shape  # a key given once
    folder = tempfile.mkdtemp(prefix="low-precision-")
    data = args.data or prepare(folder)
    if args.probe is not None:
        return probe(args.runs.split(","), data, args.steps, folder, args.shape, args.probe)
    curves, seconds = {}, {}
    for name in args.runs.split(","):
        curves[name], seconds[name] = train(name, RUNS[name], data, args.steps, folder, args.shape)
        print(f"{name}: {len(curves[name])} steps, {seconds[name]:.2f} s/step", flush=True)
    print("\n".join(compare(curves, seconds)))
    from dtensor3d.training.metrics import _chart

    if not any(curves.values()):
        return
    chart = _chart([(n, pts) for n, pts in curves.items() if pts], 720, 400, 0, "loss")
    svg = args.svg or os.path.join(folder, "loss.svg")
    with open(svg, "w") as f:
        f.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="720" height="400" font-family="sans-serif" '
                f'font-size="12">\n<rect width="100%" height="100%" fill="white"/>\n{chart}\n</svg>\n')  # fmt: skip
    print(f"loss overlay: {svg}; runs in {folder} ({len(glob.glob(folder + '/*/metrics.jsonl'))} runs)")


if __name__ == "__main__":
    main()
