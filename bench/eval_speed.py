"""Downstream evaluation's speed at world 1 (issue 39), side by side in one run:

    python bench/eval_speed.py [--limit 12] [--repeat 3]

The local tasks of the tests (tests/eval/tasks: loglikelihood, loglikelihood_rolling,
generate_until) on a random tiny Llama (2 layers, hidden 64, byte tokenizer) through
dtensor3d's model class (batch_size 8; generation batched with a KV cache, left-padded:
generate.greedy_batch) and lm-eval's own HFLM (batch_size 8) on the export-hf of the same
checkpoint. Prints seconds per 100 requests per request kind (the best of --repeat rounds,
the two taking turns in each), the ratio to HFLM, and the load average it ran under.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TASKS = {"loglikelihood": "d3d_doc_mc", "loglikelihood_rolling": "d3d_doc_ppl", "generate_until": "d3d_doc_gen"}


def tiny_checkpoint(root: Path) -> tuple[str, str]:
    import transformers

    from dtensor3d.__main__ import main
    from dtensor3d.datasets.tokenizer import byte_tokenizer, write_hf_tokenizer

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(root / "hf")
    byte_tokenizer().save(str(root / "tok.json"))
    write_hf_tokenizer(str(root / "tok.json"), str(root / "hf"))
    assert main(["import-hf", str(root / "hf"), str(root / "ck")]) == 0
    assert main(["export-hf", str(root / "ck"), str(root / "export")]) == 0
    return str(root / "ck"), str(root / "export")


def seconds(lms: dict, task: str, limit: int, repeat: int, manager) -> dict:
    """name -> the best of `repeat` harness calls of that model class on one task (the task index
    built once, outside), the classes taking turns in each round, so a machine whose load changes
    weighs on both alike."""
    from dtensor3d.harness import evaluate

    best = dict.fromkeys(lms, float("inf"))
    for _ in range(repeat):
        for name, lm in lms.items():
            start = time.perf_counter()
            evaluate(lm, [task], manager, limit=limit)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from lm_eval.models.huggingface import HFLM

    from dtensor3d.harness.lm import Dtensor3dLM

    per_doc = {"loglikelihood": 4, "loglikelihood_rolling": 1, "generate_until": 1}  # requests per document
    with tempfile.TemporaryDirectory() as tmp:
        ck, export = tiny_checkpoint(Path(tmp))
        lms = {
            "dtensor3d": Dtensor3dLM(pretrained=ck, batch_size=8),
            "HFLM": HFLM(pretrained=export, dtype="float32", batch_size=8, device="cpu"),
        }
        from lm_eval.tasks import TaskManager

        manager, rows = TaskManager(include_path=str(ROOT / "tests" / "eval" / "tasks")), {}
        for kind, task in TASKS.items():
            n = args.limit * per_doc[kind]
            found = seconds(lms, task, args.limit, args.repeat, manager)
            rows[kind] = {name: 100 * t / n for name, t in found.items()}
    print("| request kind | " + " | ".join(f"{name}, s / 100" for name in lms) + " | dtensor3d / HFLM |")
    print("|---|" + "---|" * (len(lms) + 1))
    for kind, times in rows.items():
        ratio = times["dtensor3d"] / times["HFLM"]
        print(f"| {kind} | " + " | ".join(f"{t:.3f}" for t in times.values()) + f" | {ratio:.2f} |")
    print("load average (1, 5, 15 min) at the end: " + ", ".join(f"{x:.1f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
