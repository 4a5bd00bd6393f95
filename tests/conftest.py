import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PARITY = str(ROOT / "tests" / "recipes" / "parity.yaml")


def torchrun(nproc: int, args: list[str], timeout: int = 600, fresh: bool = False) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=nproc ARGS` from the repo root, its ranks forked
    from one interpreter that has imported torch (tests/fork_torchrun.py: torch's elastic agent
    with a fork server; a rank's imports are most of a multi-rank test's time here); `fresh`:
    torchrun itself, a new interpreter per rank."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    forked = [str(ROOT / "tests" / "fork_torchrun.py"), str(nproc)]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if fresh else forked
    cmd = [sys.executable, *launcher, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def train_metrics(run_dir: Path, nproc: int, overrides: list[str], recipe: str = PARITY) -> list[dict]:
    """Train `recipe` on nproc CPU ranks and return metrics.jsonl's records. Compiled runs
    start fresh ranks: a forked pp2 x tp2 compiled run once hung in a gloo collective."""
    fresh = "training.compile=true" in overrides
    torchrun(nproc, ["-m", "dtensor3d", "train", recipe, f"logging.run_dir={run_dir}", *overrides], fresh=fresh)
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="session")
def parity_reference(tmp_path_factory):
    """The 1-process run of the parity recipe, computed once per session."""
    return train_metrics(tmp_path_factory.mktemp("ref"), 1, [])


# The parity runs' short form: 6 steps (validation at 5 and at the last) of microbatches of
# 2. A DTensor step's cost on CPU is per microbatch (its collectives and dispatch, not its
# arithmetic), so this halves a run's steps; warmup, decay, clipping and evaluation are all
# still inside. The 10-step recipe stays for the runs whose checkpoints other tests use.
SHORT = ["training.steps=6", "training.micro_batch_size=2"]


def short(overrides: list[str], keep: tuple[str, ...] = ()) -> list[str]:
    """SHORT's keys under `overrides` (a key the overrides set wins); `keep`: SHORT's keys to
    leave as the recipe has them (e.g. micro_batch_size where a schedule needs microbatches)."""
    given = {o.split("=")[0] for o in overrides} | set(keep)
    return [o for o in SHORT if o.split("=")[0] not in given] + list(overrides)


@pytest.fixture(scope="session")
def reference(parity_reference, tmp_path_factory):
    """reference(overrides, recipe): the 1-process run of `recipe` with the overrides' keys
    other than parallelism.*, each trained once per session."""
    cache = {(PARITY, ()): parity_reference}

    def get(overrides: list[str], recipe: str = PARITY) -> list[dict]:
        key = (recipe, tuple(sorted(o for o in overrides if not o.startswith("parallelism."))))
        if key not in cache:
            cache[key] = train_metrics(tmp_path_factory.mktemp("ref"), 1, list(key[1]), recipe)
        return cache[key]

    return get


# dp2 x tp2 x pp2 with checkpoints at steps 5 and 10 and the layout files: one run serves
# test_parity[dp2_tp2_pp2] (parity, layout, communication) and test_checkpoint (resume,
# reshard, export). "{root}" is the run's own directory (see shared_run).
MESH_822 = ["parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2"]
SAVES_AT_5_AND_10 = ["checkpoint.dir={root}/ck", "checkpoint.interval=5"]
# Qwen2's q/k/v biases at dp2 x tp2 in the short form, saving at steps 3 and 6: one run serves
# test_parity[qwen2_biases_dp2_tp2] and test_checkpoint's resume of it on another mesh.
QWEN2_DP2_TP2 = ["model.family=qwen2", "parallelism.dp=2", "parallelism.tp=2"]
SAVES_AT_3_AND_6 = ["checkpoint.dir={root}/ck", "checkpoint.interval=3"]


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """Runs that several tests (in several files) make with the same overrides, each trained
    once per session: get(nproc, overrides, recipe) -> (metrics records, root). The run
    directory is root / "run"; "{root}" in an override is replaced by root (for a
    checkpoint.dir of the run's own). The order of the overrides does not matter."""
    cache: dict[tuple, tuple[list[dict], Path]] = {}

    def get(nproc: int, overrides: list[str], recipe: str = PARITY) -> tuple[list[dict], Path]:
        key = (nproc, recipe, tuple(sorted(overrides)))
        if key not in cache:
            root = tmp_path_factory.mktemp("shared")
            filled = [o.replace("{root}", str(root)) for o in overrides]
            cache[key] = train_metrics(root / "run", nproc, filled, recipe), root
        return cache[key]

    return get


# ---------------------------------------------------------------- the two tiers
# `pytest -m "not slow"` (the quick tier, under 5 minutes on 2 cores): every test that runs in
# this process or starts only short-lived single processes, plus one 2-rank smoke run. Every
# other test (multi-rank runs, training runs, fault runs) is marked `slow` here, in one table,
# so a reader sees the split at once. `pytest` runs both.
QUICK_FILES = {
    "test_architecture.py",
    "test_estimate.py",
    "test_plan.py",
    "test_plan_accuracy.py",
    "test_plan_simulate.py",
    "test_prepare.py",
    "test_recipe_errors.py",
    "test_metrics.py",
    "test_generate.py",
    "test_data_door.py",
    "test_preflight.py",
    "test_mesh.py",
    "test_moe.py",
    "test_context.py",
    "test_data.py",
    "test_checkpoint_slices.py",
    "test_nanotron.py",
    "test_families.py",
    "test_family_recipes.py",
}
# Tests of those files that start ranks or train (slow all the same).
SLOW_IN_QUICK_FILES = {
    "test_estimate_equals_measured",
    "test_simulate_command_json_and_text",
    "test_profile_steps_trace_holds_the_steps_matmuls_and_collectives",
    "test_ids_beyond_the_vocabulary_under_tp2_via_launch",
    "test_device_mesh_groups_equal_rank_groups",
    "test_device_mesh_dp_cp_joins_dp_and_cp",
    "test_parallel_context_3d",
    "test_expert_parallel_dispatch_matches_local",
    "test_cp_attention_matches_single_device",
    "test_training_on_a_prepared_directory_matches_across_meshes",
    "test_save_gathers_nothing",
    "test_resume_on_another_mesh_gathers_nothing",
    "test_init_from_hf_gathers_nothing",
    "test_trains_like_the_native_recipe_at_world_1",
    "test_trains_like_the_native_recipe_on_tp2",
}
SMOKE = {"tests/test_parity.py::test_parity[dp2]"}  # the quick tier's one 2-rank run


def pytest_collection_modifyitems(config, items):
    for item in items:
        quick = item.path.name in QUICK_FILES and item.originalname not in SLOW_IN_QUICK_FILES
        if not quick and item.nodeid not in SMOKE:
            item.add_marker(pytest.mark.slow)
