"""Training throughput of the speed features (issue 13), in one run:

    python bench/throughput.py [--device cpu|cuda] [--steps 8] [--only NAME ...] [--repeat N]

Each variant trains the same model (BENCH below) through dtensor3d's own setup and
train_step under torchrun (OMP_NUM_THREADS=1 per rank) and reports the median step time of
the steps after the first two (compile: after its first step's compilation) as tokens/s:
eager vs compile, fp32 vs bf16, each recompute mode, each pipeline schedule at pp 2 (with
each rank's idle fraction beside the bubble formula's), and world 1 against a plain PyTorch
loop over transformers' LlamaForCausalLM of the same shape (same batch, same AdamW). On
CUDA it adds MFU (dtensor3d.training.metrics' peak table); on CPU it prints the machine's one-thread
matmul rate before and after the rows (the VM runs slow at times). `--repeat N` runs each variant N
times and reports the median run with the runs' spread. `--worker` is the per-rank entry point.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from common import BENCH, ROOT, bench_recipe, scratch

PP2 = ["parallelism.pp=2"]  # 4 layers, 4 microbatches of 2
# pp 4: 8 layers (2 per stage under the multi-stage schedules) and 8 microbatches, for every schedule
PP4 = ["parallelism.pp=4", "model.num_hidden_layers=8", "training.global_batch_size=16"]
ENGINES = ("1f1b", "interleaved_1f1b", "zbv", "dualpipev")


def recipe_overrides(path: str) -> list[str]:
    """A recipe's model, parallelism and training values as overrides of BENCH (its steps,
    device and logging aside): `plan --hardware cpu-gloo`'s check runs recipes/3d.yaml so."""
    import yaml

    raw, out = yaml.safe_load(open(os.path.join(ROOT, path))), []
    for section in ("model", "parallelism", "training"):
        for key, value in raw.get(section, {}).items():
            if key not in ("steps", "device", "seed"):
                out.append(f"{section}.{key}={json.dumps(value) if isinstance(value, list) else value}")
    return out


VARIANTS = {  # name -> (ranks, overrides)
    "eager fp32": (1, []),
    "compile fp32": (1, ["training.compile=true"]),
    "eager bf16": (1, ["training.dtype=bfloat16"]),
    "recompute full": (1, ["parallelism.recompute=full"]),
    "recompute selective": (1, ["parallelism.recompute=selective"]),
    "pp2 1f1b": (2, [*PP2, "parallelism.pp_engine=1f1b"]),
    "pp2 interleaved_1f1b": (2, [*PP2, "parallelism.pp_engine=interleaved_1f1b"]),
    "pp2 zbv": (2, [*PP2, "parallelism.pp_engine=zbv"]),
    "pp2 dualpipev": (2, [*PP2, "parallelism.pp_engine=dualpipev"]),
    **{f"pp4 {engine}": (4, [*PP4, f"parallelism.pp_engine={engine}"]) for engine in ENGINES},
    "dp2": (2, ["parallelism.dp=2"]),
    "tp2": (2, ["parallelism.tp=2"]),
    "3d.yaml": (16, recipe_overrides("recipes/3d.yaml")),  # its own tiny model, 16 ranks on this machine
}


def bubble(recipe) -> float:
    """The idle fraction a schedule leaves per rank in theory (m microbatches, v stages per
    rank): (pp - 1) / (v m + pp - 1); zero-bubble V schedules fill it (0)."""
    p, m = recipe.parallelism, recipe.num_microbatches
    if not p.pp_enabled:
        return 0.0
    return 0.0 if p.pp_engine in ("zbv", "dualpipev") else (p.pp - 1) / (p.stages_per_rank * m + p.pp - 1)


def worker(overrides: list[str], steps: int, device: str, out: str) -> None:
    """One rank: setup and `steps` train_steps; rank 0 writes the median step time and each
    rank's CPU-busy fraction of it."""
    import torch.distributed as dist

    from dtensor3d.datasets.sources import make_source
    from dtensor3d.training.train import rank_batch, setup, train_step

    recipe = bench_recipe(overrides, device)
    state = setup(recipe)
    source, walls, cpus = make_source(recipe), [], []
    for step in range(steps):
        batch = rank_batch(state, source, step)
        wall, cpu = time.perf_counter(), time.process_time()
        metrics = train_step(state, batch)
        if device == "cuda":
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    skip = 2 if steps > 3 else 1
    wall, cpu = statistics.median(walls[skip:]), statistics.median(cpus[skip:])
    busy = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(busy, torch.tensor([cpu / wall]))
    if dist.get_rank() == 0:
        result = {"step_s": wall, "first_step_s": walls[0], "busy": [b.item() for b in busy], "loss": metrics["loss"]}
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def run_variant(name: str, ranks: int, overrides: list[str], args) -> dict:
    out = os.path.join(scratch("result-"), "out.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", __file__]
    cmd += ["--worker", "--steps", str(args.steps), "--device", args.device, "--out", out, "--", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def hf_reference(args) -> float:
    """Seconds per step of a plain PyTorch loop over transformers' LlamaForCausalLM, same shape,
    batch (microbatches of micro_batch_size, loss summed / global tokens) and AdamW."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    m, t, o = BENCH["model"], BENCH["training"], BENCH["optimizer"]
    cfg = LlamaConfig(**m, tie_word_embeddings=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    times, tokens = [], t["global_batch_size"] * t["sequence_length"]
    for _ in range(args.steps):
        rows = torch.randint(0, m["vocab_size"], (t["global_batch_size"], t["sequence_length"] + 1), generator=gen)
        rows = rows.to(args.device)
        start = time.perf_counter()
        for mb in rows.split(t["micro_batch_size"]):
            logits = model(input_ids=mb[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), mb[:, 1:].flatten(), reduction="sum")
            (loss / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def bench_loss(model, ids: torch.Tensor, bf16: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(ids[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())


def memory_table() -> list[str]:
    """Parameter, gradient and activation bytes (kept from forward to backward, one microbatch)
    of the bench model at world 1 for each recompute mode and dtype (bf16: autocast)."""
    from dtensor3d.models import build_on_meta, materialize
    from dtensor3d.models.layers import ModelHooks
    from dtensor3d.parallel.shards import init_weights
    from dtensor3d.plan.activations import kept_bytes

    recipe, lines = bench_recipe([], "cpu"), []
    t = recipe.training
    ids = torch.randint(0, recipe.model.vocab_size, (t.micro_batch_size, t.sequence_length + 1))
    for mode, dtype in (("none", "fp32"), ("full", "fp32"), ("selective", "fp32"), ("none", "bf16")):
        model = materialize(build_on_meta(recipe.model, hooks=ModelHooks(recompute=mode)), "cpu")
        init_weights(model, 0)
        value, kept = kept_bytes(lambda m=model, b=dtype == "bf16": bench_loss(m, ids, b), model)
        value.backward()
        params = sum(p.nbytes for p in model.parameters())
        grads = sum(p.grad.nbytes for p in model.parameters())
        mib = [x / 2**20 for x in (params, grads, kept)]
        lines.append(
            f"recompute {mode:9s} {dtype}: params {mib[0]:.1f} MiB, grads {mib[1]:.1f} MiB, "
            f"activations {mib[2]:.1f} MiB"
        )
    return lines


def report(name: str, r: dict, recipe, device: str, peak: float | None, hw=None) -> str:
    """One variant's line; on CUDA with MFU against `peak` FLOP/s per device (metrics.peak_flops);
    on CPU with plan's prediction on `hw` (default: hardware.yaml's cpu-gloo)."""
    from dtensor3d.training.metrics import flops_per_token, mfu

    tokens = recipe.training.global_batch_size * recipe.training.sequence_length
    tps = tokens / r["step_s"]
    line = f"{name:22s} {tps:10,.0f} tok/s  {1000 * r['step_s']:8.0f} ms/step"
    if device == "cuda":
        flops = flops_per_token(recipe.model, recipe.training.sequence_length)
        used = mfu(tps, flops, peak, recipe.parallelism.world_size)
        line += f"  MFU {100 * used:5.1f}%" if used is not None else "  MFU n/a (GPU not in plan's peak table)"
    if recipe.parallelism.pp_enabled:
        idle = ", ".join(f"{1 - b:.2f}" for b in r["busy"])
        line += f"  idle per rank {idle} (bubble formula {bubble(recipe):.2f})"
    if "compile" in name:
        line += f"  (first step with compilation {r['first_step_s']:.0f} s)"
    if device == "cpu":  # plan's performance model on this machine's entry (dtensor3d/plan/hardware.yaml)
        from dtensor3d.plan.hardware import lookup
        from dtensor3d.plan.perf import predict

        hw = hw or lookup("cpu-gloo")
        planned = predict(recipe, hw, 1)["tokens_per_sec"]
        line += f"  plan --hardware {hw.name} {planned:,.0f} tok/s ({100 * (planned / tps - 1):+.0f}%)"
    if len(r.get("runs_s", [])) > 1:
        fast, slow = (tokens / s for s in (r["runs_s"][0], r["runs_s"][-1]))
        line += f"  [{len(r['runs_s'])} runs: {1000 * r['runs_s'][0]:.0f}-{1000 * r['runs_s'][-1]:.0f} ms/step"
        if device == "cpu":
            line += f", plan {100 * (planned / fast - 1):+.0f}% to {100 * (planned / slow - 1):+.0f}%"
        line += "]"
    return line


def median_run(runs: list[dict]) -> dict:
    """The run of median step time, with every run's step time (`runs_s`): on a shared VM whole runs
    of the same variant differ by more than their steps do (docs/benchmarks.md, the eighth look)."""
    runs = sorted(runs, key=lambda r: r["step_s"])
    return {**runs[len(runs) // 2], "runs_s": [r["step_s"] for r in runs]}


def machine_speed() -> float:
    """This machine's one-thread matmul rate now, GFLOP/s (hardware_probe.matmul_gflops: the bench
    model's GEMM shape). Printed before and after the rows: the VM runs slow at times (every row
    slower than plan's cpu-gloo entry, the multi-rank ones most), and this tells such a run."""
    from hardware_probe import matmul_gflops

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return matmul_gflops()
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--only", nargs="*", help="variant names to run (default: all)")
    ap.add_argument(
        "--repeat", type=int, default=1, help="runs of each variant: the median run is reported, with the runs' spread"
    )
    ap.add_argument("--hardware", default="cpu-gloo", help="plan's entry the CPU rows are compared with")
    ap.add_argument("--hardware-file", help="a hardware file with it (bench/hardware_probe.py --write)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.overrides, args.steps, args.device, args.out)
    t = BENCH["training"]
    tokens, results = t["global_batch_size"] * t["sequence_length"], {}
    from dtensor3d.training.metrics import peak_flops

    peak = peak_flops(torch.device(args.device))  # None on CPU
    from dtensor3d.errors import RecipeError
    from dtensor3d.plan.hardware import lookup

    try:
        hw = lookup(args.hardware, args.hardware_file)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"model {BENCH['model']}, {tokens} tokens/step (pp4: 8 layers, 2x tokens), median of steps 3..{args.steps}")
    before = machine_speed() if args.device == "cpu" else None
    for name, (ranks, overrides) in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        results[name] = median_run([run_variant(name, ranks, overrides, args) for _ in range(args.repeat)])
        print(report(name, results[name], bench_recipe(overrides, args.device), args.device, peak, hw), flush=True)
    if not args.only:
        print("\n".join(memory_table()), flush=True)
    hf = hf_reference(args)
    print(f"{'transformers (plain)':22s} {tokens / hf:10,.0f} tok/s  {1000 * hf:8.0f} ms/step")
    for name in ("eager fp32", "compile fp32"):
        if name in results:
            print(f"ratio {name} / transformers: {hf / results[name]['step_s']:.2f}")
    if before is not None:
        print(f"machine: a one-thread matmul {before:.1f} GFLOP/s before the rows, {machine_speed():.1f} after")


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
