"""The README's tour, run as written, shrunk by overrides (issue 36): its one block marked
`<!-- readme-test: run -->` runs in a scratch directory (links to launch.sh and recipes/),
with the standard library's json package for the corpus and 2 steps per training run. The
install and test blocks are .ci/run's own commands (tests/test_docs.py checks that). Slow: it
starts processes."""

import os
import re
import subprocess
import sys

from helpers import ROOT

# What shrinks the tour: the corpus, the steps (no validation: a small corpus has no held-out
# documents at 1%), and nothing else.
SHRINK = [
    ('"$STDLIB/**/*.py"', '"$STDLIB/json/*.py"'),
]
LAUNCH_OVERRIDES = " training.steps=2 training.eval_every=0"


def tour() -> str:
    text = (ROOT / "README.md").read_text()
    (block,) = re.findall(r"<!-- readme-test: run -->\n```bash\n(.*?)```", text, re.S)
    for old, new in SHRINK:
        assert old in block, old
        block = block.replace(old, new)
    lines = [line + LAUNCH_OVERRIDES if line.startswith("bash launch.sh ") else line for line in block.splitlines()]
    return "set -euo pipefail\n" + "\n".join(lines) + "\n"


def test_readme_tour_runs(tmp_path):
    for name in ("launch.sh", "recipes"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHON=sys.executable, PATH=f"{os.path.dirname(sys.executable)}:{env['PATH']}")
    proc = subprocess.run(["bash", "-c", tour()], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    out = proc.stdout
    assert "prepared data/stdlib" in out and out.count("done: metrics") == 2
    assert (tmp_path / "out" / "text-hf" / "config.json").is_file()
    assert "initialised from Hugging Face weights" in out
    assert "simulated rank 1023 of 1024" in out and "agrees" in out
