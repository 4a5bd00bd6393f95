"""The cost of document masking (data.document_masking) on this machine, side by side:

    python bench/document_masking.py [--steps 12] [--device cpu|cuda]

One process (world 1), one model and optimizer (throughput.py's BENCH model, sequence 256),
one prepared directory of short documents (byte tokenizer, 8 to 160 bytes each: 1 to 30
documents per window) written to a temporary directory. Steps alternate between the same
global batch with its documents' position_ids / document_ids (masked) and without (plain
causal attention), so both see the same machine load; the median of each after the first
two is reported as tokens/s, both by wall time and by this process's CPU time (on a machine
shared with other work the CPU time is the steadier of the two). A second line times the
attention alone (forward + backward of one layer's q, k, v): SDPA causal against SDPA with
the document mask.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def prepared_dir(folder: str) -> str:
    from dtensor3d.__main__ import main

    rng = random.Random(0)
    rows = ["".join(rng.choice("abcdefgh ijkl") for _ in range(rng.randint(8, 160))) for _ in range(3000)]
    with open(os.path.join(folder, "docs.jsonl"), "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in rows)
    out = os.path.join(folder, "out")
    args = ["prepare-data", os.path.join(folder, "docs.jsonl"), "--out", out, "--tokenizer", "byte"]
    assert main([*args, "--val-fraction", "0", "--no-progress"]) == 0
    return out


def train_steps(data: str, steps: int, device: str) -> tuple[dict, float]:
    """{(masked, clock): median seconds per step} for masked True/False and clock "wall"/"cpu",
    and the mean documents per window."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from common import bench_recipe

    from dtensor3d.datasets.sources import make_source
    from dtensor3d.training.train import rank_batch, setup, train_step

    data_keys = [f"data.path={data}", "data.kind=tokens", "data.document_masking=true", "data.validation=null"]
    recipe = bench_recipe(data_keys, device)
    state, source = setup(recipe), make_source(recipe)
    times: dict[tuple, list[float]] = {(m, c): [] for m in (True, False) for c in ("wall", "cpu")}
    docs = []
    for step in range(2 * steps):
        masked = step % 2 == 0
        batch = rank_batch(state, source, step // 2)
        docs.append(float(batch[2]["document_ids"].max(1).values.float().mean() + 1))
        wall, cpu = time.perf_counter(), time.process_time()
        train_step(state, batch if masked else batch[:2])
        if device == "cuda":
            torch.cuda.synchronize()
        times[masked, "wall"].append(time.perf_counter() - wall)
        times[masked, "cpu"].append(time.process_time() - cpu)
    return {key: statistics.median(t[2:]) for key, t in times.items()}, statistics.mean(docs)


def attention_alone(device: str, repeats: int = 20) -> tuple[float, float]:
    """(masked, causal) median seconds of one layer's attention forward + backward, batch 2."""
    from dtensor3d.models.layers import causal_attention, document_attention

    g = torch.Generator().manual_seed(0)
    b, h, kv, s, d = 2, 8, 4, 256, 32
    q, k, v = (torch.randn(b, n, s, d, generator=g).to(device).requires_grad_() for n in (h, kv, kv))
    lengths = torch.randint(8, 160, (b, 64), generator=g).cumsum(1)
    ids = torch.stack([torch.searchsorted(row, torch.arange(s), right=True) for row in lengths]).to(device)
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(2 * repeats):
        masked = i % 2 == 0
        start = time.perf_counter()
        out = document_attention(q, k, v, ids) if masked else causal_attention(q, k, v)
        out.sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times[masked].append(time.perf_counter() - start)
    return statistics.median(times[True][2:]), statistics.median(times[False][2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    with tempfile.TemporaryDirectory() as folder:
        med, docs = train_steps(prepared_dir(folder), args.steps, args.device)
    tokens = 8 * 256
    print(f"train step, world 1, {tokens} tokens, {docs:.1f} documents per window (median of {args.steps - 2}):")
    for clock in ("wall", "cpu"):
        plain, masked = med[False, clock], med[True, clock]
        print(
            f"  {clock:4s} plain causal {tokens / plain:7,.0f} tok/s, document masked {tokens / masked:7,.0f} tok/s, "
            f"masked / plain {plain / masked:.3f}"
        )
    am, ac = attention_alone(args.device)
    print(f"attention alone (fwd + bwd, [2, 8 heads, 256, 32]): causal {1e3 * ac:.2f} ms, masked {1e3 * am:.2f} ms")


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
