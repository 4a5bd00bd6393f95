"""tp_linear_async_communication against the key off, in one process set: for each tp mode,
two training steps per setup (the same seed and batches). Setups (`--setups`, default
off,on): `off` / `on` eager with the key off / on, the second step counted by
dtensor3d.parallel.comm (tp collectives issued, how many saw a matmul run before their
wait, the seconds waited); `on_compiled`: the key on under training.compile, both steps
uncounted (comm's dispatch mode makes dynamo run a compiled block eager). Prints one JSON
line per (mode, setup) on rank 0.

usage: torchrun --nproc_per_node=N async_tp.py [--setups off,on,on_compiled] RECIPE [key=value ...]
"""

import contextlib
import json
import os
import sys

import torch.distributed as dist
from torch._dynamo.utils import counters

from dtensor3d.config.load import load_recipe
from dtensor3d.datasets.sources import make_source
from dtensor3d.parallel.comm import count_step
from dtensor3d.training.train import rank_batch, setup, train_step

SETUPS = {
    "off": ["parallelism.tp_linear_async_communication=false"],
    "on": ["parallelism.tp_linear_async_communication=true"],
    "on_compiled": ["parallelism.tp_linear_async_communication=true", "training.compile=true"],
}


def run(recipe_path: str, overrides: list[str], counted: bool) -> dict:
    recipe = load_recipe(recipe_path, overrides, world_size=int(os.environ["WORLD_SIZE"]))
    state = setup(recipe)
    source = make_source(recipe)
    breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    first = train_step(state, rank_batch(state, source, 0))
    with count_step(state.mesh) if counted else contextlib.nullcontext() as counter:
        second = train_step(state, rank_batch(state, source, 1))
    out = {
        "metrics": [{k: m[k] for k in ("loss", "grad_norm")} for m in (first, second)],
        # dynamo's graphs traced and graph breaks met in this setup (0 and 0 when eager)
        "graphs": counters["stats"]["unique_graphs"] - graphs,
        "graph_breaks": sum(counters["graph_break"].values()) - breaks,
    }
    if counter is not None:
        out["issued"] = {k: dict(v) for k, v in counter.issued.items()}
        out["overlapped"] = {k: dict(v) for k, v in counter.overlapped.items()}
        out["wait_s"] = dict(counter.wait_s)
    return out


def main() -> None:
    args = sys.argv[1:]
    setups = args.pop(0).removeprefix("--setups=").split(",") if args[0].startswith("--setups=") else ["off", "on"]
    recipe_path, *overrides = args
    for mode in ("ALL_REDUCE", "REDUCE_SCATTER"):
        for name in setups:
            given = [*overrides, f"parallelism.tp_mode={mode}", *SETUPS[name]]
            out = run(recipe_path, given, counted=name != "on_compiled")
            if dist.get_rank() == 0:
                print("ASYNC " + json.dumps({"mode": mode, "setup": name, **out}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
