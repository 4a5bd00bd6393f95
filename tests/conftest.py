import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PARITY = str(ROOT / "tests" / "recipes" / "parity.yaml")


def torchrun(nproc: int, args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    """Run `torchrun --standalone --nproc_per_node=nproc ARGS` from the repo root."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def train_metrics(run_dir: Path, nproc: int, overrides: list[str], recipe: str = PARITY) -> list[dict]:
    """Train `recipe` on nproc CPU ranks and return metrics.jsonl's records."""
    torchrun(nproc, ["-m", "dtensor3d", "train", recipe, f"logging.run_dir={run_dir}", *overrides])
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="session")
def parity_reference(tmp_path_factory):
    """The 1-process run of the parity recipe, computed once per session."""
    return train_metrics(tmp_path_factory.mktemp("ref"), 1, [])
