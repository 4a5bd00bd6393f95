"""`python -m dtensor3d plan`: the layout of a recipe, without launching anything."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def plan(*args):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    return subprocess.run(
        [sys.executable, "-m", "dtensor3d", "plan", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_plan_json_3d():
    p = plan("recipes/3d.yaml", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert set(out) == {"world_size", "dims", "groups", "estimate", "fsdp_reshard"}
    # fsdp_reshard_after_forward auto: a tiny model fits this machine, never with each stage's 2 layers in one unit
    assert out["fsdp_reshard"]["after_forward"] == "never" and out["fsdp_reshard"]["bucket_layers"] == 2
    assert out["world_size"] == 16
    assert out["dims"] == {"ep": 1, "pp": 2, "dp": 4, "cp": 1, "tp": 2}
    assert list(out["dims"]) == ["ep", "pp", "dp", "cp", "tp"]  # nanotron's order
    g = out["groups"]
    assert {"tp", "pp", "dp", "cp", "ep", "dp_cp"} <= set(g)
    # rank = pp*8 + dp*2 + tp
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert g["pp"] == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert g["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g["cp"] == [[r] for r in range(16)]
    assert g["ep"] == [[r] for r in range(16)]
    assert g["dp_cp"] == g["dp"]  # cp = 1


def test_plan_json_with_overrides_and_world():
    p = plan("recipes/3d.yaml", "parallelism.dp=2", "parallelism.context_parallel_size=2", "--world", "16", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["world_size"] == 16
    assert out["dims"] == {"ep": 1, "pp": 2, "dp": 2, "cp": 2, "tp": 2}
    g = out["groups"]
    # rank = pp*8 + dp*4 + cp*2 + tp
    assert g["cp"][:2] == [[0, 2], [1, 3]]
    assert g["dp"][:2] == [[0, 4], [1, 5]]
    assert g["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]


def test_plan_wrong_world_fails():
    p = plan("recipes/3d.yaml", "--world", "8")
    assert p.returncode == 2
    assert p.stdout == ""
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:")
    assert "parallelism" in lines[0] and "16" in lines[0] and "8" in lines[0]
    assert "Traceback" not in p.stderr


def test_plan_text_rank_table():
    p = plan("recipes/3d.yaml")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "world size 16: ep=1 pp=2 dp=4 cp=1 tp=2"
    header = next(i for i, line in enumerate(lines) if line.split() == ["rank", "ep", "pp", "dp", "cp", "tp"])
    rows = [list(map(int, line.split())) for line in lines[header + 1 : header + 17]]
    assert [r[0] for r in rows] == list(range(16))
    for rank, ep, pp, dp, cp, tp in rows:
        assert (ep, pp, dp, cp, tp) == (0, rank // 8, rank // 2 % 4, 0, rank % 2)
    assert "tp groups: [0, 1] [2, 3]" in p.stdout
    assert "dp groups: [0, 2, 4, 6] [1, 3, 5, 7] [8, 10, 12, 14] [9, 11, 13, 15]" in p.stdout
    assert "2 microbatches" in p.stdout


def test_plan_debug_is_one_rank():
    p = plan("recipes/debug.yaml", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["world_size"] == 1
    assert all(groups == [[0]] for groups in out["groups"].values())


STAGE_KEYS = {"stage", "params", "param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "peak_bytes"}


def test_plan_json_estimate_shape():
    p = plan("recipes/3d.yaml", "--json", "--gpu", "h100", "--mfu", "0.5")
    assert p.returncode == 0, p.stderr
    est = json.loads(p.stdout)["estimate"]
    assert [s["stage"] for s in est["stages"]] == [0, 1]
    for s in est["stages"]:
        assert STAGE_KEYS <= set(s)
        assert s["peak_bytes"] > s["param_bytes"] + s["grad_bytes"] + s["optimizer_bytes"] + s["activation_bytes"] - 1
    assert set(est["comm_bytes_per_step"]) == {"tp", "dp", "pp", "cp", "ep", "world"}
    for kinds in est["comm_bytes_per_step"].values():
        assert kinds["total"] == sum(v for k, v in kinds.items() if k != "total")
    assert est["bubble_fraction"] == 1 / 3  # pp 2, 2 microbatches
    assert est["peak_tflops"] == 989.0 and est["mfu"] == 0.5
    assert est["tokens_per_sec"] * est["step_time_s"] == pytest.approx(16 * 64)


def test_plan_text_estimate():
    p = plan("recipes/3d.yaml", "--peak-tflops", "100")
    assert p.returncode == 0, p.stderr
    assert "estimate per rank" in p.stdout and "pipeline bubble 33.3%" in p.stdout
    assert "at 100 TFLOP/s x MFU 0.4 x 16 ranks" in p.stdout
    assert "not for CPU training" not in p.stdout


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--gpu", "V100"], ["V100", "H100"]),
        (["--mfu", "0"], ["--mfu", "(0, 1]"]),
        (["--mfu", "1.5"], ["--mfu"]),
        (["--peak-tflops", "-3"], ["--peak-tflops"]),
        (["--gpu", "H100", "--peak-tflops", "5"], ["one of"]),
        (["--mfu", "x"], ["--mfu"]),
    ],
)
def test_plan_bad_flags(flags, words):
    p = plan("recipes/3d.yaml", *flags)
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and all(w in lines[0] for w in words), p.stderr


# Llama-3-70B has 70,553,706,496 parameters. Under sequence parallelism its 161 norm
# weights (8,192 each) are whole on every tp rank; everything else is split over tp x dp.
LLAMA3_70B = 70_553_706_496


def test_planning_recipes():
    p = plan("recipes/llama3_70b_plan.yaml", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["world_size"] == 1024 and out["dims"] == {"ep": 1, "pp": 8, "dp": 16, "cp": 1, "tp": 8}
    held = sum(s["params"] for s in out["estimate"]["stages"]) * 8 * 16
    assert held == LLAMA3_70B + 7 * 161 * 8192
    p = plan("recipes/llama3_405b_plan.yaml", "--gpu", "H200")
    assert p.returncode == 0, p.stderr
    assert "world size 1024: ep=1 pp=16 dp=4 cp=2 tp=8" in p.stdout
    assert "not for CPU training" in p.stdout and "tokens/s at 989 TFLOP/s" in p.stdout
    assert len(p.stdout.splitlines()) < 60  # 1,024 ranks: the table is elided


ESTIMATE_KEYS = {"stages", "flops_per_step", "comm_bytes_per_step", "bubble_fraction"}


@pytest.mark.parametrize(
    "engine, stages, layers, bubble",
    [
        # interleaved: rank r holds stages r and r + 2; bubble (p-1)/(v m + p-1), m = 8, v = 2
        ("interleaved_1f1b", [[0, 2], [1, 3]], [[[0, 0], [2, 2]], [[1, 1], [3, 3]]], 1 / 17),
        # zbv: a V, rank 0 holds the first and the last stage; bubble i/(6 m + i), i = p - 1 = 1
        ("zbv", [[0, 3], [1, 2]], [[[0, 0], [3, 3]], [[1, 1], [2, 2]]], 1 / 49),
    ],
    ids=["interleaved_1f1b", "zbv"],
)
def test_plan_multi_stage_schedules(engine, stages, layers, bubble):
    """One row per pp rank (what --simulate --rank R compares against), summing its stages."""
    args = ["tests/recipes/parity.yaml", "parallelism.pp=2", f"parallelism.pp_engine={engine}"]
    p = plan(*args, "--json")
    assert p.returncode == 0, p.stderr
    est = json.loads(p.stdout)["estimate"]
    assert set(est) == ESTIMATE_KEYS
    assert [s["stage"] for s in est["stages"]] == [0, 1]
    assert [s["pp_stages"] for s in est["stages"]] == stages
    assert [s["stage_layers"] for s in est["stages"]] == layers
    assert all(STAGE_KEYS <= set(s) for s in est["stages"])
    assert est["bubble_fraction"] == pytest.approx(bubble)
    text = plan(*args).stdout
    assert f"pipeline bubble {100 * bubble:.1f}% ({engine})" in text
    row = next(line for line in text.splitlines() if line.split()[:2] == ["0", f"{layers[0][0][0]},{layers[0][1][0]}"])
    assert f"{est['stages'][0]['params']:,}" in row
