"""Elastic data parallelism: a job whose node count may change while it runs.

`NNODES=MIN:MAX` (torchrun's elastic range) with `parallelism.dp: auto` (dp = world / (ep*pp*cp*tp))
and `NPROC_PER_NODE` processes on each node. How a resize flows:

1. **The door** (`check_node_range`, from launch.sh's `validate`): every world size the range allows,
   MIN*NPROC_PER_NODE .. MAX*NPROC_PER_NODE, is checked against the recipe (dp divides, the global
   batch splits into whole microbatches, ...) before anything starts.
2. **The rendezvous** (torch's c10d, `supervise.py`): when a node is lost for good, the other nodes'
   ranks fail in their next collective and their agents re-form the rendezvous with the nodes that
   are left (at least MIN, after `RDZV_LAST_CALL_S` for stragglers; the lost node leaves the
   rendezvous after `RDZV_KEEP_ALIVE_S` of silence, torch's 15 s by default); when a node comes back, the
   running agents see it waiting, stop their ranks (SIGTERM: they save at the step boundary) and
   re-form with it.
3. **Reshard resume** (`checkpoint/resume.py`): every rank loads the newest complete checkpoint on the
   new mesh; `global_batch_size` and the sample order stay (sample i depends on the seed and i only),
   the microbatches per rank change, and rank 0 prints one line: `resized: dp 4 -> 2 (node 1 lost),
   global batch 16 kept, 2 -> 4 microbatches per rank`. metrics.jsonl keeps each step once (a resumed
   run drops the records past its checkpoint).

This module must not import torch (the door runs before any process starts).
"""

from __future__ import annotations

from ..errors import RecipeError


def node_range(text: str) -> tuple[int, int]:
    """NNODES: "N" -> (N, N); "MIN:MAX" -> (MIN, MAX); a RecipeError line otherwise."""
    parts = text.split(":")
    ok = 1 <= len(parts) <= 2 and all(p.strip().isdigit() for p in parts)
    lo, hi = (int(parts[0]), int(parts[-1])) if ok else (0, 0)
    if not ok or lo < 1:
        raise RecipeError(f"NNODES={text!r} must be a positive integer N or an elastic range MIN:MAX (e.g. 1:2)")
    if lo > hi:
        raise RecipeError(
            f"NNODES={text}: MIN {lo} is larger than MAX {hi}; write MIN:MAX with MIN <= MAX, e.g. {hi}:{lo}"
        )
    return lo, hi


def check_node_range(load, auto: bool, nnodes: str, nproc: int):
    """launch.sh's door for the node count: returns (the recipe at the largest world, processes per
    node). `load(world_size)` loads the recipe at a world size (None: as written)."""
    lo, hi = node_range(nnodes)
    if auto and lo == hi:
        raise RecipeError(
            f"parallelism.dp=auto is for elastic jobs, but NNODES={nnodes} is fixed; give NNODES=MIN:MAX "
            f"(e.g. 1:{max(hi, 2)}) or set parallelism.dp to a number"
        )
    if lo < hi and not auto:
        raise RecipeError(
            f"NNODES={nnodes} is an elastic range, so dp must follow the world size: set parallelism.dp=auto "
            f"(and NPROC_PER_NODE), or give a fixed NNODES"
        )
    if auto:
        return _check_each_world(load, lo, hi, nproc), nproc
    recipe = load(None)
    world = recipe.parallelism.world_size
    if world % hi:
        raise RecipeError(f"NNODES={hi}: the world size {world} is not divisible by it; valid: a divisor of {world}")
    if nproc and nproc != world // hi:
        raise RecipeError(
            f"NPROC_PER_NODE={nproc} but the recipe's world size {world} over NNODES={hi} is {world // hi} "
            f"processes per node; unset NPROC_PER_NODE, or use parallelism.dp=auto"
        )
    return recipe, world // hi


def _check_each_world(load, lo: int, hi: int, nproc: int):
    if nproc < 1:
        raise RecipeError(
            "parallelism.dp=auto: set NPROC_PER_NODE (the processes on each node, e.g. 8 for 8 GPUs); the world "
            "size, and so dp, follows the number of nodes"
        )
    recipes, errors = {}, {}
    for n in range(lo, hi + 1):
        try:
            recipes[n] = load(n * nproc)
        except RecipeError as e:
            errors[n] = str(e)
    if errors and len(set(errors.values())) == 1 and not recipes:
        raise RecipeError(next(iter(errors.values())))  # wrong whatever the world size
    for n, text in errors.items():
        raise RecipeError(
            f"NNODES={lo}:{hi} with NPROC_PER_NODE={nproc}: at {n} node(s) (world size {n * nproc}) the recipe "
            f"cannot run: {text}"
        )
    return recipes[hi]
