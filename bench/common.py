"""Code the benchmarks share: the repository root, the benchmark model's recipe, and the
side-by-side row. Imports nothing from the other bench scripts (no import circle)."""

import atexit
import os
import shutil
import statistics
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The model every throughput-style benchmark trains (throughput.py, document_masking.py).
BENCH = {
    "model": dict(
        vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
    ),
    "training": dict(sequence_length=256, global_batch_size=8, micro_batch_size=2, steps=1000, eval_every=0),
    "optimizer": dict(lr=1e-4, warmup_steps=0, decay="constant"),
}  # fmt: skip


def scratch(prefix: str) -> str:
    """A new folder under the system's temporary one, removed when this process ends."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, True)
    return path


def bench_recipe(overrides: list[str], device: str):
    from dtensor3d.config.checks import validate
    from dtensor3d.config.load import recipe_from_dict

    raw = {k: dict(v) for k, v in BENCH.items()}
    raw["training"]["device"] = device
    raw["logging"] = {"run_dir": scratch("bench-")}
    recipe = recipe_from_dict(raw, overrides)
    validate(recipe)
    return recipe


def line(name: str, peer_name: str, ours_v: list[float], peer_v: list[float], unit: str, higher: bool = True) -> str:
    """A row: the medians over rounds, their ratio, and with several rounds the range of the
    ratios round by round (each round's two runs measured side by side)."""
    o, p = statistics.median(ours_v), statistics.median(peer_v)
    ratio = o / p if higher else p / o
    text = f"{name:28s} dtensor3d {o:10,.1f} {unit:6s} {peer_name:30s} {p:10,.1f} {unit:6s} ratio {ratio:5.2f}"
    per_round = [a / b if higher else b / a for a, b in zip(ours_v, peer_v)]
    return text + (f"  (rounds {min(per_round):.2f}-{max(per_round):.2f})" if len(per_round) > 1 else "")
