"""plan's performance model against the runs others published (tests/plan/published_runs.yaml):
prints each row's reported and predicted throughput and the error, as a Markdown table.

    python bench/published_runs.py
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "plan"))

from test_published_runs import ROWS, predicted_and_reported  # noqa: E402


def main() -> None:
    print("| run | hardware | reported | predicted | error | kept as |")
    print("|---|---|---:|---:|---:|---|")
    for row in ROWS:
        predicted, reported = predicted_and_reported(row)
        ((key, _),) = row["reported"].items()
        unit = "TFLOP/s/GPU" if key == "tflops_per_gpu" else "tok/s/GPU"
        kept = f"known error: {row['known_error']['reason']}" if "known_error" in row else "within +-20%"
        error = f"{100 * (predicted / reported - 1):+.1f}%"
        print(f"| {row['name']} | {row['hardware']} | {reported:,.0f} {unit} | {predicted:,.0f} | {error} | {kept} |")


if __name__ == "__main__":
    main()
