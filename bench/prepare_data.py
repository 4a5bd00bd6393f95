"""prepare-data throughput on Python's standard library source (`*.py`, site-packages excluded).

    python bench/prepare_data.py [--vocab 8192] [--workers 1 2] [--out /tmp/bench_prepare]

1. `prepare-data --train-tokenizer VOCAB`: trains a byte-level BPE on the corpus, then encodes it.
2. `prepare-data --tokenizer <the trained tokenizer.json>` once per --workers value: encoding only.
Each row: wall seconds, CPU seconds of the command (user + sys, its children included), input
MB per wall second and per CPU second, tokens per wall second. The machine may be shared:
MB per CPU second is the figure that does not depend on other load.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import sysconfig
import time


def run(args: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of `python -m dtensor3d prepare-data ARGS`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "dtensor3d", "prepare-data", *args, "--no-progress"], check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default="/tmp/bench_prepare")
    a = ap.parse_args()
    corpus = [os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), "--exclude", "*/site-packages/*"]
    trained = os.path.join(a.out, "trained")
    rows = [("train + encode", *run([*corpus, "--out", trained, "--train-tokenizer", str(a.vocab), "--overwrite"]))]
    for w in a.workers:
        out = os.path.join(a.out, f"w{w}")
        tok = os.path.join(trained, "tokenizer.json")
        rows.append(
            (
                f"encode, workers {w}",
                *run([*corpus, "--out", out, "--tokenizer", tok, "--overwrite", "--workers", str(w)]),
            )
        )
    with open(os.path.join(trained, "meta.json")) as f:
        meta = json.load(f)
    mb, tokens = meta["bytes"] / 1e6, sum(s["tokens"] for s in meta["splits"].values())
    print(f"corpus: {mb:.1f} MB, {tokens:,} tokens, vocab {meta['vocab_size']}, cpus {os.cpu_count()}")
    print(f"{'step':<20} {'wall s':>8} {'cpu s':>8} {'MB/s wall':>10} {'MB/cpu-s':>9} {'tokens/s':>11}")
    for name, wall, cpu in rows:
        print(f"{name:<20} {wall:8.1f} {cpu:8.1f} {mb / wall:10.2f} {mb / cpu:9.2f} {tokens / wall:11,.0f}")


if __name__ == "__main__":
    main()
