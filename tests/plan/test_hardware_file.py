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
    fields = [*hardware_probe.WHAT, "inter_node_gbps"]
    base = {f: float(getattr(hw, f)) or 0.1 for f in fields}  # cpu-gloo's shared_idle is 0
    passes = [{f: v * scale for f, v in base.items()} | {"_gflops": 1.0} for scale in (1.0, 3.0, 2.0)]
    path = tmp_path / "here.yaml"
    path.write_text(yaml.safe_dump(hardware_probe.median_entry(passes, hw, "cpu-here")))
    got = lookup("CPU-Here", str(path))
    for f in fields:
        assert getattr(got, f) == pytest.approx(2 * base[f], rel=1e-3), f
    assert (got.cores_per_node, got.collective_steps, got.gpus_per_node) == (os.cpu_count(), "ring", hw.gpus_per_node)
    assert "--repeat 3" in got.source
    idle_free = [p | {"shared_idle": 0.0} for p in passes]  # no core ever idle: the field's default, left out
    entry = hardware_probe.median_entry(idle_free, hw, "cpu-busy")["cpu-busy"]
    assert "shared_idle" not in entry and "shared_core_factor" in entry
    tp2 = load_recipe(str(REPO / "recipes/3d.yaml"), ["parallelism.dp=1", "parallelism.pp=1"])
    slower = dict(hardware_probe.median_entry(passes, hw, "cpu-here")["cpu-here"])
    slower.update({f: getattr(hw, f) for f in ("bf16_tflops", "fp8_tflops", "fp32_tflops", "hbm_gbps")})  # same compute
    path.write_text(yaml.safe_dump({"cpu-slow-host": slower}))
    assert predict(tp2, lookup("cpu-slow-host", str(path)), 1)["step_time_s"] > predict(tp2, hw, 1)["step_time_s"]


def test_a_cpu_entry_runs_fp32_at_its_fp32_peak_and_bf16_at_its_bf16_peak():
    """cpu-gloo's fp32_tflops and fp32_attention_fraction price an fp32 recipe's matmuls, attention and
    MFU exactly as an entry whose bf16 figures were those (a GPU entry: no fp32 fields); a bf16 recipe
    takes the bf16 GEMM rate, ~29x slower on this machine (no native bf16 GEMMs), whatever fp32's is."""
    from dataclasses import replace

    cpu = lookup("cpu-gloo")
    world_1 = ["parallelism.dp=1", "parallelism.pp=1", "parallelism.tp=1"]
    fp32 = load_recipe(str(REPO / "recipes/3d.yaml"), world_1)
    bf16 = load_recipe(str(REPO / "recipes/3d.yaml"), [*world_1, "training.dtype=bfloat16"])
    as_bf16 = replace(cpu, bf16_tflops=cpu.fp32_tflops, attention_fraction=cpu.fp32_attention_fraction, fp32_tflops=0.0)
    got, same = predict(fp32, cpu, 1), predict(fp32, as_bf16, 1)
    for key in ("matmul_s", "attention_s"):
        assert got["breakdown_s"][key] == pytest.approx(same["breakdown_s"][key], rel=1e-12), key
    assert got["mfu"] == pytest.approx(same["mfu"], rel=1e-12)
    slow = predict(bf16, cpu, 1)["breakdown_s"]["matmul_s"]
    assert slow == predict(bf16, replace(cpu, fp32_tflops=3 * cpu.fp32_tflops), 1)["breakdown_s"]["matmul_s"]
    assert slow > 20 * got["breakdown_s"]["matmul_s"]
