"""The chaos soak's small form (issue 26): `bench/chaos.py` drives a real launch.sh job (dp 2 x tp 2)
through 4 seeded faults (seed 5: a full disk during a save, a hang past training.timeout_s, a
corrupt newest checkpoint, a killed rank), relaunching it whenever it ends, and
checks every step once and losses bitwise equal to an uninterrupted run. The long form
(K >= 20 over >= 200 steps) is a benchmark: BENCHMARKS.md."""

from __future__ import annotations

import re
import subprocess
import sys

from helpers import ROOT, clean_env


def test_chaos_small_form_survives_every_fault(tmp_path):
    proc = subprocess.run(
        [sys.executable, "bench/chaos.py", "--steps", "10", "--faults", "4", "--seed", "5", "--work", str(tmp_path)],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert len(re.findall(r"^step \d+: fault \d \(", proc.stdout, re.M)) == 4, out
    assert "every step once: True; losses and grad norms bitwise equal to the uninterrupted run: True" in out, out
    assert re.search(r"^faults injected 4, survived 4, steps lost 0, wall overhead -?\d+%$", proc.stdout, re.M), out
