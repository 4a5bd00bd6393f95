"""`torchrun --standalone --nproc_per_node=N` for the test suite, less one interpreter start
per rank: `python tests/fork_torchrun.py N (-m MODULE | SCRIPT) ARGS...`.

It runs torch's own elastic agent (torch.distributed.launcher.api.elastic_launch, what
torchrun runs) with start_method "forkserver" and a function entrypoint: the fork server
imports torch and dtensor3d once, and each rank is a fork of it that starts at once. On
this 2-core machine importing torch, DTensor and dynamo costs a rank ~4.5 CPU-seconds, a
16-rank job ~70 (the most of its start-up); the suite starts some 400 ranks. What a rank
runs is unchanged: the module or script under "__main__" with its arguments, as torchrun
gives it (RANK, WORLD_SIZE, MASTER_ADDR, ... in the environment). Tests that are about a
fresh process (the launcher, signals, the door) still start their own.
"""

from __future__ import annotations

import multiprocessing
import runpy
import sys
import uuid
from pathlib import Path

from torch.distributed.launcher.api import LaunchConfig, elastic_launch

# What every rank imports (torch._dynamo: torch's own optimizer and meta init import it at run
# time), imported once by the fork server before it forks the ranks.
PRELOAD = ["torch._dynamo", "torch.distributed.pipelining", "dtensor3d.__main__", "dtensor3d.training.train"]


def run_rank(target: list[str]) -> None:
    """One rank: `-m MODULE ARGS` or `SCRIPT ARGS` under "__main__", as a new interpreter would."""
    if target[0] == "-m":
        sys.argv = [target[1], *target[2:]]
        code = _exit_code(lambda: runpy.run_module(target[1], run_name="__main__", alter_sys=True))
    else:
        sys.argv = list(target)
        sys.path.insert(0, str(Path(target[0]).resolve().parent))  # as `python SCRIPT` does
        code = _exit_code(lambda: runpy.run_path(target[0], run_name="__main__"))
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        sys.exit(code)


def _exit_code(run) -> int:
    try:
        run()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def main(argv: list[str]) -> int:
    nproc, target = int(argv[0]), argv[1:]
    # forkserver, not fork: the ranks are forked by a single-threaded server process that
    # imported these modules once, never by this one, whose agent runs threads (the
    # rendezvous store) whose locks a plain fork could copy held (a 16-rank run hung so).
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        start_method="forkserver",
    )
    sys.stdout.flush()
    elastic_launch(config, run_rank)(target)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
