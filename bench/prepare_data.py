"""prepare-data throughput on Python's standard library source (`*.py`, site-packages excluded).

    python bench/prepare_data.py [--vocab 8192] [--workers 1 2] [--out /tmp/bench_prepare]

1. `prepare-data --train-tokenizer VOCAB`: trains a byte-level BPE on the corpus, then encodes it
   (the tokenizer's training time, from prepare-data's summary line, is shown on its own row).
2. `prepare-data --tokenizer <the trained tokenizer.json>` once per --workers value: encoding only.
3. The ceiling: the Rust tokenizer alone, `Tokenizer.encode_batch_fast` over the same documents
   (already in memory, 8 MB per call, its own threads), in a fresh process.
Each row: wall seconds, CPU seconds of the command (user + sys, its children included), input
MB per wall second and per CPU second, tokens per wall second. The machine may be shared:
MB per CPU second is the figure that does not depend on other load.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import sysconfig
import time


def run(args: list[str]) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds, stdout) of `python -m dtensor3d prepare-data ARGS`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "dtensor3d", "prepare-data", *args, "--no-progress"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(out.strip(), flush=True)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), out


def raw_encode(tokenizer_json: str, trained_dir: str) -> None:
    """--raw: time encode_batch_fast alone on the documents prepare-data read; prints wall and CPU s."""
    from tokenizers import Tokenizer

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from dtensor3d.datasets.inputs import expand_inputs, read_text_file

    with open(os.path.join(trained_dir, "meta.json")) as f:
        files = expand_inputs(json.load(f)["inputs"][:1], ["*/site-packages/*"])
    texts = [t for t, _ in map(read_text_file, files) if t]
    tok = Tokenizer.from_file(tokenizer_json)
    tok.encode_special_tokens = True  # as prepare-data's encoder
    batches, size = [[]], 0
    for text in texts:  # about 8 MB per call, as prepare-data's in-process encoder
        batches[-1].append(text)
        size += len(text)
        if size >= 8 << 20:
            batches.append([])
            size = 0
    cpu0, start = time.process_time(), time.perf_counter()
    for b in batches:
        tok.encode_batch_fast(b, add_special_tokens=False)
    print(time.perf_counter() - start, time.process_time() - cpu0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default="/tmp/bench_prepare")
    ap.add_argument("--raw", nargs=2, metavar=("TOKENIZER", "TRAINED_DIR"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.raw:
        return raw_encode(*a.raw)
    corpus = [os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), "--exclude", "*/site-packages/*"]
    trained = os.path.join(a.out, "trained")
    wall, cpu, out = run([*corpus, "--out", trained, "--train-tokenizer", str(a.vocab), "--overwrite"])
    train_s = float(re.search(r"tokenizer trained in ([0-9.]+) s", out).group(1))
    rows = [("train + encode", wall, cpu), ("  of which training", train_s, float("nan"))]
    for w in a.workers:
        out = os.path.join(a.out, f"w{w}")
        tok = os.path.join(trained, "tokenizer.json")
        rows.append(
            (
                f"encode, workers {w}",
                *run([*corpus, "--out", out, "--tokenizer", tok, "--overwrite", "--workers", str(w)])[:2],
            )
        )
    raw = subprocess.run(
        [sys.executable, __file__, "--raw", os.path.join(trained, "tokenizer.json"), trained],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    rows.append(("encode_batch_fast alone", float(raw[0]), float(raw[1])))
    with open(os.path.join(trained, "meta.json")) as f:
        meta = json.load(f)
    mb, tokens = meta["bytes"] / 1e6, sum(s["tokens"] for s in meta["splits"].values())
    print(f"corpus: {mb:.1f} MB, {tokens:,} tokens, vocab {meta['vocab_size']}, cpus {os.cpu_count()}")
    print(f"{'step':<20} {'wall s':>8} {'cpu s':>8} {'MB/s wall':>10} {'MB/cpu-s':>9} {'tokens/s':>11}")
    for name, wall, cpu in rows:
        print(f"{name:<20} {wall:8.1f} {cpu:8.1f} {mb / wall:10.2f} {mb / cpu:9.2f} {tokens / wall:11,.0f}")


if __name__ == "__main__":
    main()
