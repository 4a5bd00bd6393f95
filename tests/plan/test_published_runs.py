"""plan's performance model (plan/perf.py) against training runs others published
(tests/plan/published_runs.yaml: each row's source, layout, hardware and reported
throughput), and `plan --hardware`'s door. In-process and torch-free."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dtensor3d.config.load import load_recipe
from dtensor3d.plan.hardware import FIELDS, check_nodes, lookup
from dtensor3d.plan.perf import predict

REPO = Path(__file__).resolve().parents[2]
ROWS = yaml.safe_load((Path(__file__).with_name("published_runs.yaml")).read_text())
TOLERANCE = 0.20


def predicted_and_reported(row: dict) -> tuple[float, float]:
    """The model's prediction of the row's reported quantity, and that quantity."""
    recipe = load_recipe(str(REPO / row["recipe"]), row["overrides"])
    hw = lookup(row["hardware"])
    nodes = check_nodes(None, recipe.parallelism.world_size, hw)
    out = predict(recipe, hw, nodes, float8=row.get("float8", False), sac_matmuls=row.get("sac_matmuls", 0.0))
    ((key, value),) = row["reported"].items()
    if key == "gpu_hours_per_trillion_tokens":
        key, value = "tokens_per_sec_per_gpu", 1e12 / (value * 3600)
    return out[key], value


def test_table_holds_the_runs_the_issue_names():
    names = [r["name"] for r in ROWS]
    assert sum(n.startswith("llama3-405b") for n in names) == 3
    assert sum(n.startswith("torchtitan-llama3.1") for n in names) >= 3
    assert any(n.startswith("deepseek-v3") for n in names)
    assert len(names) == len(set(names)) and len(names) >= 10
    others = [r for r in ROWS if not any(w in r["source"] for w in ("torchtitan", "2407.21783", "2412.19437"))]
    assert len(others) >= 3  # runs found beyond the ones the issue names (and beyond torchtitan's folder)
    assert all(r["source"] for r in ROWS)
    assert sum("known_error" in r for r in ROWS) <= 2


@pytest.mark.parametrize("row", ROWS, ids=[r["name"] for r in ROWS])
def test_prediction_within_tolerance_of_published_run(row):
    predicted, reported = predicted_and_reported(row)
    error = predicted / reported - 1
    if "known_error" in row:  # kept in the table with its measured error and reason
        assert f"{100 * error:+.1f}%" == row["known_error"]["error"], error
        return
    assert abs(error) <= TOLERANCE, f"{row['name']}: predicted {predicted:.1f}, reported {reported:.1f}"


def plan(*args):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    cmd = [sys.executable, "-m", "dtensor3d", "plan", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_hardware_json_gives_every_term():
    p = plan("recipes/llama3_1_8b_plan.yaml", "--hardware", "H100", "--json")
    assert p.returncode == 0, p.stderr
    perf = json.loads(p.stdout)["performance"]
    assert perf["hardware"] == "h100-sxm" and perf["nodes"] == 8
    terms = perf["breakdown_s"]
    assert {"matmul_s", "attention_s", "memory_s", "tp_s", "bubble_s", "dp_exposed_s", "optimizer_s"} <= set(terms)
    assert perf["step_time_s"] >= sum(terms.values()) - 1e-6
    assert perf["tokens_per_sec_per_gpu"] * perf["step_time_s"] * 64 == pytest.approx(256 * 8192)
    assert 0 < perf["mfu"] < 1 and perf["bound"] + "_s" in terms and perf["advice"]


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--hardware", "v100"], ["v100", "h100-sxm", "mi300x", "cpu-gloo"]),
        (["--hardware", "h100", "--nodes", "3"], ["--nodes 3", "16"]),
        (["--nodes", "2"], ["--nodes", "--hardware"]),
    ],
)
def test_hardware_door(flags, words):
    p = plan("recipes/3d.yaml", *flags)
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and all(w in lines[0] for w in words), p.stderr


def test_hardware_file_missing_a_field(tmp_path):
    f = tmp_path / "hw.yaml"
    f.write_text("mine:\n  bf16_tflops: 100\n  fp8_tflops: 200\n")
    p = plan("recipes/3d.yaml", "--hardware", "MINE", "--hardware-file", str(f))
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "'mine'" in lines[0] and "hbm_gbps" in lines[0]


def test_shared_cores_terms_scale_an_oversubscribed_cpu_node_only():
    """shared_core_factor, shared_collective_cpu_us and shared_idle (hardware_probe's 8 processes a
    core) stretch 3d.yaml's 16 ranks on 2 cores (core-bound); a 2-rank run and GPU entries are unchanged."""
    from dataclasses import replace

    from dtensor3d.plan.perf import shared

    cpu = lookup("cpu-gloo")
    three_d = load_recipe(str(REPO / "recipes/3d.yaml"), [])
    two = load_recipe(str(REPO / "recipes/3d.yaml"), ["parallelism.dp=1", "parallelism.pp=1"])
    step = predict(three_d, cpu, 1)["step_time_s"]
    assert predict(three_d, replace(cpu, shared_idle=0.1), 1)["step_time_s"] == pytest.approx(step / 0.9, rel=1e-9)
    slower = replace(cpu, shared_core_factor=1.2)
    assert step < predict(three_d, slower, 1)["step_time_s"] < 1.2 * step  # the collectives' core time unscaled
    calls = replace(cpu, shared_collective_cpu_us=3 * cpu.collective_cpu_us)
    assert predict(three_d, calls, 1)["step_time_s"] > step
    probed = replace(cpu, shared_core_factor=1.2, shared_collective_cpu_us=300, shared_idle=0.1)
    assert predict(two, probed, 1)["step_time_s"] == predict(two, cpu, 1)["step_time_s"]
    assert shared(probed, 8) == pytest.approx((1 + 0.2 * 3 / 7, 0.1 * 3 / 7, 3 / 7))  # 4 ranks a core
    assert all(shared(lookup(name), 8) == (1.0, 0.0, 0.0) for name in ("h100", "b200", "mi300x"))


def test_ring_steps_count_gloos_algorithms_per_kind(tmp_path):
    """cpu-gloo's collective_steps: ring. A call's steps by kind (an all-reduce 2 (n - 1), a
    reduce-scatter too -- gloo runs it as an all-reduce --, an all-gather n - 1, a send 1); GPU
    entries ceil(log2 n). 3d.yaml's calls by kind are what a real run of it counted (logging.layout's
    comm_calls, 2 steps, 16 ranks, where auto picks never with 2 layers a unit): stage 0 tp 18
    all-reduces, stage 1 24; dp 2 all-gathers and 2 reduce-scatters; world one all-reduce (the step
    times' all-gather runs outside the counted step). A CPU entry adds collective_wake_us to each
    call. A hardware file with another collective_steps is one error line."""
    from dtensor3d.errors import RecipeError
    from dtensor3d.plan.collectives import comm_bytes
    from dtensor3d.plan.params import rank_parts
    from dtensor3d.plan.perf import _calls, call_steps, kind_calls

    cpu, h100 = lookup("cpu-gloo"), lookup("h100")
    assert [call_steps(cpu, k, 4) for k in ("all_reduce", "reduce_scatter", "all_gather", "send_recv")] == [6, 6, 3, 1]
    assert [call_steps(h100, k, 8) for k in ("all_reduce", "reduce_scatter", "all_gather")] == [3, 3, 3]
    recipe = load_recipe(
        str(REPO / "recipes/3d.yaml"),
        ["parallelism.fsdp_reshard_after_forward=never", "parallelism.fsdp_bucket_layers=2"],
    )
    got = []
    for part, per_dim in zip(rank_parts(recipe), comm_bytes(recipe, "nccl")):
        calls = _calls(recipe, part)
        got.append({d: kind_calls(recipe, part, d, per_dim[d], calls[d]) for d in ("tp", "dp", "world")})
    assert [g["tp"] for g in got] == [{"all_reduce": 18}, {"all_reduce": 24}]
    assert all(g["dp"] == {"all_gather": 2, "reduce_scatter": 2} for g in got)
    assert all(g["world"] == {"all_reduce": 1, "all_gather": 1} for g in got)
    # each call between eager work wakes gloo's threads again: collective_wake_us on tp 2's exposed calls
    from dataclasses import replace

    tp2 = load_recipe(str(REPO / "recipes/3d.yaml"), ["parallelism.dp=1", "parallelism.pp=1"])
    asleep = predict(tp2, replace(cpu, collective_wake_us=0), 1)["stages"][0]["tp_s"]
    woken = predict(tp2, cpu, 1)["stages"][0]["tp_s"] - asleep
    assert woken == pytest.approx(_calls(tp2, rank_parts(tp2)[0])["tp"] * cpu.collective_wake_us * 1e-6)
    f = tmp_path / "hw.yaml"
    f.write_text(yaml.safe_dump({"mine": {**{k: 1 for k in FIELDS}, "collective_steps": "tree"}}))
    with pytest.raises(RecipeError, match="collective_steps: 'tree'; valid: log2, ring"):
        lookup("mine", str(f))
