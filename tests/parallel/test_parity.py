"""Loss parity: every parallel configuration against the 1-process run of the same recipe,
step by step (AdamW, fp32, CPU; 6 steps of microbatches of 2, helpers.SHORT, or the recipe's
10 where a run is shared). Relative difference <= 1e-5 for loss and
grad_norm at every step; tensor parallelism on this CPU typically lands near 1e-7."""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from helpers import (
    MESH_822,
    PARITY,
    QWEN2_DP2_TP2,
    ROOT,
    SAVES_AT_3_AND_6,
    SAVES_AT_5_AND_10,
    TIED_TP2_PP2,
    assert_parity,
    check_comm,
    check_layout,
    scheduled_lrs,
    short,
    train_metrics,
    world,
)

from dtensor3d.config.load import load_recipe

# The combinations of options (dp_mode, dp, cp, tp and tp_mode, pp and its schedules,
# recompute, compile, dtype, tied embeddings, families, RoPE scaling, experts) are the
# combination matrix's (tests/parallel/test_matrix.py: every pair of option values in some
# run). Here: the quick tier's smoke run, the runs other tests share (checkpoints) and what
# the matrix's table leaves out (tp 4, cp 4, pp 4, uneven stages, 16 ranks).
CONFIGS = {
    "dp2": ["parallelism.dp=2"],
    # tp 4 ALL_REDUCE: one kv head per rank.
    "tp4": ["parallelism.tp=4", "parallelism.tp_mode=ALL_REDUCE"],
    # pp 4 with tied embeddings: the embedding group is a 2-rank group of stages 0 and 3
    "pp4_1f1b_8mb_tied_embeddings": [
        "parallelism.pp=4",
        "training.micro_batch_size=1",
        "model.tie_word_embeddings=true",
    ],
    # tp 2 x pp 2 with tied embeddings: a copy on each stage, their gradients summed every step.
    "tp2_pp2_tied_embeddings": [*TIED_TP2_PP2, "parallelism.tp_mode=REDUCE_SCATTER"],
    "dp2_tp2_pp2": ["parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2"],
    # Context parallelism at 4, by nanotron's key (context_parallel_size, cp's alias).
    "cp4": ["parallelism.context_parallel_size=4"],
    # tp_linear_async_communication under sequence parallelism at dp 2 x tp 2 (ALL_REDUCE:
    # the 3d recipe's run below; tp 2 alone, both modes: test_async_tp); FSDP2 keeps the
    # parameters gathered for the step (fsdp_reshard_after_forward never: one all-gather
    # per step over the two microbatches, which check_comm counts) in units of two blocks.
    "dp2_tp2_sp_async": [
        *("parallelism.dp=2", "parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER"),
        "parallelism.tp_linear_async_communication=true",
        "parallelism.fsdp_reshard_after_forward=never",
        "parallelism.fsdp_bucket_layers=2",
    ],
    # Uneven stages (README: pp_layers, e.g. [3, 1]): layers 0-2 on stage 0, layer 3 on stage 1.
    # Its 4 microbatches are summed, not averaged (torchtitan #1733): grad_norm / 4 fails step 1.
    "pp2_uneven_layers": ["parallelism.pp=2", "parallelism.pp_layers=[3, 1]"],
    # Four dimensions at once (16 ranks, beyond the matrix's 8).
    "pp2_dp2_cp2_tp2": [
        "parallelism.pp=2",
        "parallelism.dp=2",
        "parallelism.cp=2",
        "parallelism.tp=2",
        "parallelism.tp_mode=REDUCE_SCATTER",
    ],
    # Qwen2's q/k/v biases (column-parallel, split with their rows) at dp 2 x tp 2; its
    # checkpoints resume on another mesh in test_checkpoint.
    "qwen2_biases_dp2_tp2": QWEN2_DP2_TP2,
}


# Configurations whose run test_checkpoint also uses (conftest.shared_run): the same run, saving
# checkpoints as it goes (saving leaves training bitwise unchanged: test_checkpoint).
SHARED = {
    "dp2_tp2_pp2": SAVES_AT_5_AND_10,
    "qwen2_biases_dp2_tp2": SAVES_AT_3_AND_6,
    "tp2_pp2_tied_embeddings": SAVES_AT_3_AND_6,
    "dp2_tp2_tied_embeddings": SAVES_AT_3_AND_6,
}
# FSDP2 units of the runs that group blocks: the root and the 4 blocks in pairs.
FSDP_UNITS = {"dp2_tp2_sp_async": 3}
LONG = {"dp2_tp2_pp2"}  # keeps the recipe's 10 steps (its checkpoints at 5 and 10)
assert CONFIGS["dp2_tp2_pp2"] == MESH_822


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parity(name, reference, shared_run, record_property):
    # The shared run keeps the 10-step recipe (its checkpoints); the others run its short form.
    overrides = CONFIGS[name] if name in LONG else short(CONFIGS[name])
    got, root = shared_run(world(overrides), overrides + ["logging.layout=true"] + SHARED.get(name, []))
    # Every rank holds every parameter as the plans promise (the parallelism is really on).
    check_layout(root / "run", load_recipe(PARITY, overrides))
    # ...and hands each collective the bytes the configuration implies (plan's estimate).
    check_comm(root / "run", load_recipe(PARITY, overrides))
    for key, rel in assert_parity(got, reference(overrides), scheduled_lrs(PARITY, overrides)).items():
        record_property(f"max_rel_{key}", rel)  # shown with --junitxml
    if name in FSDP_UNITS:  # one all-gather and one reduce-scatter per FSDP2 unit in the step
        for f in (root / "run" / "layout").glob("rank*.json"):
            calls = json.loads(f.read_text())["comm_calls"]["dp"]
            assert calls == {"all_gather": FSDP_UNITS[name], "reduce_scatter": FSDP_UNITS[name]}, (f.name, calls)
    # The run learned something: the loss falls over the steps.
    assert got[-1]["loss"] < got[0]["loss"]


def launch(recipe: str, overrides: list[str]) -> subprocess.CompletedProcess:
    """`bash launch.sh RECIPE OVERRIDES` from the repository root, as the README runs it."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHON=sys.executable)
    cmd = ["bash", "launch.sh", recipe, *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def test_parity_3d_recipe(tmp_path, record_property):
    """`bash launch.sh recipes/3d.yaml` itself (dp4 x pp2 x tp2, 16 ranks; 6 steps instead of
    30) against its 1-process run. The same run shows the README's outputs (metrics.jsonl's
    fields, the resolved recipe.yaml, loss.svg, one console line per step), with
    tp_linear_async_communication on (its ALL_REDUCE path at dp 4 x pp 2 x tp 2)."""
    recipe = str(ROOT / "recipes" / "3d.yaml")
    # eval_every 5: the validation loss at steps 5 and 6, which assert_parity compares too.
    common = ["training.steps=6", "training.device=cpu", "training.eval_every=5", "training.eval_batches=1"]
    ref = train_metrics(
        tmp_path / "one", 1, common + ["parallelism.dp=1", "parallelism.pp=1", "parallelism.tp=1"], recipe
    )
    run = tmp_path / "sixteen"
    given = [*common, "parallelism.tp_linear_async_communication=true", f"logging.run_dir={run}"]
    proc = launch(recipe, given)
    got = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for key, rel in assert_parity(got, ref, scheduled_lrs(recipe, common)).items():
        record_property(f"max_rel_{key}", rel)
    check_outputs(run, got, proc.stdout, load_recipe(recipe, given))


def check_outputs(run: Path, records: list[dict], stdout: str, recipe) -> None:
    """README 'Outputs': metrics.jsonl's fields, recipe.yaml with the overrides, loss.svg, the console."""
    tokens = recipe.training.global_batch_size * recipe.training.sequence_length
    peaks = [r["peak_mem_gib"] for r in records]
    for r in records:
        assert {"step", "loss", "grad_norm", "lr", "tokens_per_sec", "ms_per_step", "peak_mem_gib", "mfu"} <= set(r)
        assert r["mfu"] is None  # GPU only
        assert r["ms_per_step"] > 0
        assert math.isclose(r["tokens_per_sec"] * r["ms_per_step"] / 1000, tokens, rel_tol=1e-9)
    assert 0 < peaks[0] <= 24 and peaks == sorted(peaks), peaks  # a peak (resident set on CPU) only grows
    # recipe.yaml is the resolved recipe: fsdp_reshard_after_forward: auto as the run decided it
    saved = load_recipe(str(run / "recipe.yaml"))
    assert saved.parallelism.fsdp_reshard_after_forward in ("never", "default", "always"), saved.parallelism
    decided = {k: getattr(saved.parallelism, k) for k in ("fsdp_reshard_after_forward", "fsdp_bucket_layers")}
    resolved = dataclasses.replace(recipe, parallelism=dataclasses.replace(recipe.parallelism, **decided))
    assert saved == resolved and recipe.training.steps == 6  # 30 in the file
    svg = ET.parse(run / "loss.svg").getroot()
    lines = [e for e in svg.iter() if e.tag.endswith("polyline")]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert [len(e.get("points").split()) for e in lines] == [len(records)] + ([len(vals)] if vals else [])
    every = vals + [r["loss"] for r in records]
    labels = {e.text for e in svg.iter() if e.tag.endswith("text")}  # the loss axis: lowest and highest
    assert {f"{min(every):.3f}", f"{max(every):.3f}"} <= labels, labels
    logged = [int(m[1]) for m in re.finditer(r"^step\s+(\d+) \|", stdout, re.M)]
    assert logged == [r["step"] for r in records] == list(range(1, 7)), stdout[-2000:]
