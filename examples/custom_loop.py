"""Your own training loop on dtensor3d's pieces (docs/guides/library.md).

The recipe gives the mesh, the model and the optimizer (`dtensor3d.setup`); this file owns
the data iterator, the loop and the logging. It reads a token file written by
`numpy.save` (int64, 1-D): global batch k is windows k*B .. k*B+B-1 of sequence_length + 1
tokens, the order `data.kind: tokens` reads a single token file in, so a recipe with
`data.path` set to the same file trains the same trajectory under launch.sh.

    torchrun --standalone --nproc_per_node=4 examples/custom_loop.py RECIPE TOKENS.npy LOG.jsonl \
        parallelism.dp=2 parallelism.tp=2
"""

import json
import sys

import numpy as np
import torch
import torch.distributed as dist

import dtensor3d


def global_batches(path: str, batch: int, length: int):
    """Yield [batch, length + 1] int64 windows, in file order, for as long as the file lasts."""
    tokens = np.load(path, mmap_mode="r")
    windows = (len(tokens) - 1) // length
    for k in range(windows // batch):
        rows = [tokens[(k * batch + i) * length : (k * batch + i) * length + length + 1] for i in range(batch)]
        yield torch.from_numpy(np.stack(rows).astype(np.int64))


def my_rows(batch: torch.Tensor, recipe, coords: dict[str, int]) -> torch.Tensor:
    """This rank's rows: each microbatch of micro_batch_size * dp rows is split over dp in rank
    order (tp and pp peers share their dp rank's rows)."""
    p, mbs = recipe.parallelism, recipe.training.micro_batch_size
    dp, rank = p.batch_ranks, p.batch_rank(coords)
    picks = [m + rank * mbs + j for m in range(0, len(batch), mbs * dp) for j in range(mbs)]
    return batch[picks]


def main(recipe_path: str, tokens: str, log_path: str, *overrides: str) -> None:
    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    recipe = dtensor3d.load_recipe(recipe_path, [*overrides, "data.kind=tokens", f"data.path={tokens}"], world)
    state = dtensor3d.setup(recipe)  # process group, mesh, parallel model on its devices, optimizer
    t = recipe.training
    log = open(log_path, "w") if dist.get_rank() == 0 else None
    for batch in global_batches(tokens, t.global_batch_size, t.sequence_length):
        if state.step == t.steps:
            break
        rows = my_rows(batch, recipe, state.coords).to(state.device)
        metrics = dtensor3d.train_step(state, (rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))
        if log:
            log.write(json.dumps(metrics) + "\n")
            print(
                f"step {metrics['step']}: loss {metrics['loss']:.6f} grad_norm {metrics['grad_norm']:.4f}", flush=True
            )
    if log:
        log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
