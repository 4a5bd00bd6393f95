"""The machine at the door (dtensor3d/preflight.py) and the command line's own manners,
through the real command line: a read-only logging.run_dir, more CUDA processes than CUDA
devices, `plan ... | head`, and the resolved recipe reloading under the stricter checks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import clean_env, one_error_line

from dtensor3d.config.load import load_recipe
from dtensor3d.config.schema import EXPERT_ONLY

REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "recipes" / "debug.yaml")


def read_only_mount_works(target: Path) -> bool:
    """Whether this process may mount a read-only tmpfs in a mount namespace of its own."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o ro tmpfs "{target}"'], capture_output=True, timeout=30
    )
    return probe.returncode == 0


def run_on_read_only(target: Path, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """argv with `target` a read-only file system (a tmpfs mounted read-only in a private mount
    namespace: root cannot write there either, and nothing outside this command sees it)."""
    script = f'mount -t tmpfs -o ro tmpfs "{target}" && exec "$@"'
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", *argv],
        cwd=cwd,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("where", ["run_dir", "parent"])
def test_read_only_run_dir_refused_at_the_door(tmp_path, where):
    """A read-only mount where this process may make one; else (root without CAP_SYS_ADMIN,
    as on this CI) an immutable directory (chattr +i), which root cannot write either."""
    target = tmp_path / "ro"
    target.mkdir()
    mounted = read_only_mount_works(target)
    if not mounted and subprocess.run(["chattr", "+i", str(target)], capture_output=True).returncode:
        pytest.skip("neither a private read-only mount (needs CAP_SYS_ADMIN) nor chattr +i here")
    run_dir = target if where == "run_dir" else target / "run"
    try:
        for argv in (
            [sys.executable, "-m", "dtensor3d", "validate", RECIPE, f"logging.run_dir={run_dir}"],
            [sys.executable, "-m", "dtensor3d", "train", RECIPE, f"logging.run_dir={run_dir}"],
            ["bash", str(REPO / "launch.sh"), RECIPE, f"logging.run_dir={run_dir}"],
        ):
            if mounted:
                line = one_error_line(run_on_read_only(target, argv, tmp_path), quiet=True)
                assert f"logging.run_dir='{run_dir}'" in line and "read-only file system" in line, line
            else:
                proc = subprocess.run(argv, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120)
                line = one_error_line(proc, quiet=True)
                assert f"logging.run_dir='{run_dir}'" in line and "not writable (permission denied)" in line, line
    finally:
        if not mounted:
            subprocess.run(["chattr", "-i", str(target)], check=True)
    # The same directory, writable: accepted (the refusal above is the mount, not the path).
    proc = subprocess.run(
        [sys.executable, "-m", "dtensor3d", "validate", RECIPE, f"logging.run_dir={run_dir}"],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout == "1\n", proc.stderr
    assert not (target / "run").exists()  # validate creates nothing


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through mode bits; see the read-only mount test")
def test_unwritable_run_dir_without_root(tmp_path):
    target = tmp_path / "locked"
    target.mkdir()
    target.chmod(0o555)
    try:
        line = one_error_line(
            subprocess.run(
                [sys.executable, "-m", "dtensor3d", "validate", RECIPE, f"logging.run_dir={target / 'run'}"],
                env=clean_env(),
                capture_output=True,
                text=True,
                timeout=120,
            ),
            quiet=True,
        )
    finally:
        target.chmod(0o755)
    assert "not writable" in line and "permission denied" in line, line


def test_plan_into_a_closed_pipe_exits_quietly():
    """`plan ... | head`: the reader is gone before plan writes; no BrokenPipeError traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write now fails with EPIPE, as after `head` has exited
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "dtensor3d", "plan", str(REPO / "recipes" / "3d.yaml")],
            stdout=write_end,
            stderr=subprocess.PIPE,
            env=clean_env(),
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert proc.stderr == "" and proc.returncode == 0, (proc.returncode, proc.stderr)


def test_plan_piped_into_head():
    """The real pipeline: only the first line comes through, and nothing on stderr."""
    proc = subprocess.run(
        ["bash", "-c", f'"{sys.executable}" -m dtensor3d plan "{REPO}/recipes/3d.yaml" | head -n 1'],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.startswith("world size 16") and proc.stdout.count("\n") == 1, proc.stdout


@pytest.mark.skipif(
    not shutil.which("nvidia-smi"), reason="needs a CUDA machine: more processes per node than CUDA devices"
)
def test_more_cuda_processes_than_devices():
    import torch

    count = torch.cuda.device_count()
    dp = count + 1  # one process more than there are devices (micro_batch_size 2: a batch of 2*dp)
    args = ["training.device=cuda", f"parallelism.dp={dp}", f"training.global_batch_size={2 * dp}"]
    proc = subprocess.run(
        [sys.executable, "-m", "dtensor3d", "validate", RECIPE, *args],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = one_error_line(proc, quiet=True)
    assert f"{dp} processes on this node but {count} CUDA device" in line, line


@pytest.mark.parametrize("recipe", ["debug.yaml", "moe.yaml"])
def test_resolved_recipe_reloads(tmp_path, recipe):
    """The resolved recipe (to_dict, as written to <run_dir>/recipe.yaml) loads again under the
    checks of a user's recipe: a dense model's expert settings are left out, an MoE's kept."""
    r = load_recipe(str(REPO / "recipes" / recipe))
    d = r.to_dict()
    assert all((k in d["model"]) == bool(r.model.num_local_experts) for k in EXPERT_ONLY), d["model"]
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    assert load_recipe(str(path)) == r
