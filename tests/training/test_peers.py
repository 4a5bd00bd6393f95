"""bench/peers.py --quick: every row (training at world 1, dp 2 and tp 2 against their peers,
generate against transformers') prints a number for both sides and their ratio. No time is
asserted (BENCHMARKS.md has the full run's figures)."""

import os
import re
import subprocess
import sys

import pytest
from helpers import ROOT

ROWS = (
    "world 1",
    "dp 2 replicate",
    "dp 2 shard",
    "dp 2 shard, reshard never",
    "dp 2 shard, never, bucket 4",
    "tp 2 ALL_REDUCE",
    "tp 2 ALL_REDUCE async",
    "tp 2 REDUCE_SCATTER",
    "tp 2 REDUCE_SCATTER async",
    "generate (after start-up)",
    "one-token process",
)
NUMBER = r"(\d[\d,]*\.\d)"


@pytest.mark.bench
def test_peers_quick_prints_every_row():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "bench/peers.py", "--quick"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for row in ROWS:
        pattern = rf"^{re.escape(row)}\s+dtensor3d\s+{NUMBER} .+?\s{NUMBER} \S+\s+ratio\s+(\d+\.\d\d)$"
        m = re.search(pattern, proc.stdout, re.M)
        assert m, (row, proc.stdout)
        assert all(float(g.replace(",", "")) > 0 for g in m.groups()), m.group(0)
    for row in (r for r in ROWS if r.startswith("dp 2")):
        assert re.search(rf"^{re.escape(row)}: parallel efficiency .* \d\.\d\d$", proc.stdout, re.M), proc.stdout
