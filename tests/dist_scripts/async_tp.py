"""tp_linear_async_communication against the key off, in one 2-rank process: for each tp
mode, two training steps with the key off and on (the same seed and batches), the second
counted by dtensor3d.parallel.comm (tp collectives issued, how many saw a matmul run before
their wait, the seconds waited). Prints one JSON line per (mode, key) on rank 0.

usage: torchrun --nproc_per_node=2 async_tp.py RECIPE [key=value ...]
"""

import json
import sys

import torch.distributed as dist

from dtensor3d.config.load import load_recipe
from dtensor3d.datasets.sources import make_source
from dtensor3d.parallel.comm import count_step
from dtensor3d.training.train import rank_batch, setup, train_step


def run(recipe_path: str, overrides: list[str]) -> dict:
    recipe = load_recipe(recipe_path, overrides, world_size=dist.get_world_size() if dist.is_initialized() else 2)
    state = setup(recipe)
    source = make_source(recipe)
    first = train_step(state, rank_batch(state, source, 0))
    with count_step(state.mesh) as counter:
        second = train_step(state, rank_batch(state, source, 1))
    return {
        "metrics": [{k: m[k] for k in ("loss", "grad_norm")} for m in (first, second)],
        "issued": {k: dict(v) for k, v in counter.issued.items()},
        "overlapped": {k: dict(v) for k, v in counter.overlapped.items()},
        "wait_s": dict(counter.wait_s),
    }


def main() -> None:
    recipe_path, *overrides = sys.argv[1:]
    for mode in ("ALL_REDUCE", "REDUCE_SCATTER"):
        for key in ("false", "true"):
            given = [*overrides, f"parallelism.tp_mode={mode}", f"parallelism.tp_linear_async_communication={key}"]
            out = run(recipe_path, given)
            if dist.get_rank() == 0:
                print("ASYNC " + json.dumps({"mode": mode, "async": key == "true", **out}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
