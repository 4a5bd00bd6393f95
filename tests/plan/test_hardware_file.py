"""bench/hardware_probe.py --repeat N --write F: a machine's probed figures as a hardware file
that `plan --hardware-file F` and `bench/throughput.py --hardware-file F` read. The probes are
timings (bench/, not the suite); this checks what a set of passes turns into, with passes made
from cpu-gloo's own figures scaled by hand."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

from dtensor3d.config.load import load_recipe
from dtensor3d.plan.hardware import lookup
from dtensor3d.plan.perf import predict

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import hardware_probe  # noqa: E402


def test_probed_passes_become_a_hardware_file_plan_reads(tmp_path):
    """Three passes at 1x, 3x and 2x cpu-gloo's figures: the entry written is the median pass (2x)
    field by field, with this machine's cores and the ring step model, and loads by name
    (case-insensitive) through --hardware-file; its slower host and links make plan slower."""
    hw = lookup("cpu-gloo")
    fields = [*hardware_probe.WHAT, "fp8_tflops", "inter_node_gbps"]
    base = {f: float(getattr(hw, f)) or 0.1 for f in fields}  # cpu-gloo's shared_idle is 0
    passes = [{f: v * scale for f, v in base.items()} | {"_gflops": 1.0} for scale in (1.0, 3.0, 2.0)]
    path = tmp_path / "here.yaml"
    path.write_text(yaml.safe_dump(hardware_probe.median_entry(passes, hw, "cpu-here")))
    got = lookup("CPU-Here", str(path))
    for f in fields:
        assert getattr(got, f) == pytest.approx(2 * base[f], rel=1e-3), f
    assert (got.cores_per_node, got.collective_steps, got.gpus_per_node) == (os.cpu_count(), "ring", hw.gpus_per_node)
    assert "--repeat 3" in got.source
    tp2 = load_recipe(str(REPO / "recipes/3d.yaml"), ["parallelism.dp=1", "parallelism.pp=1"])
    slower = dict(hardware_probe.median_entry(passes, hw, "cpu-here")["cpu-here"])
    slower.update(bf16_tflops=hw.bf16_tflops, fp8_tflops=hw.fp8_tflops, hbm_gbps=hw.hbm_gbps)  # same compute
    path.write_text(yaml.safe_dump({"cpu-slow-host": slower}))
    assert predict(tp2, lookup("cpu-slow-host", str(path)), 1)["step_time_s"] > predict(tp2, hw, 1)["step_time_s"]
