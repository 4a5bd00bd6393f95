"""Checkpoint save / resume / init_from_hf without gathering: count, on every rank, the
collectives and DTensor gathers issued while a checkpoint is saved or loaded, and check
what was saved or loaded against the full tensors (gathered afterwards, outside the count).

usage: torchrun ... ckpt_slices.py save|load|hf PATH RECIPE [key=value ...]
  save: train 2 steps, save with the training loop's Saver (PATH: checkpoint.dir)
  load: resume from the step directory PATH
  hf:   load the Hugging Face directory PATH (init_from_hf)
Prints one JSON line per rank: {"rank", "gathers", "collectives", "allreduce_elems",
"placements", "mismatched", "compared"}.
"""

import json
import os
import sys
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from dtensor3d.checkpoint.background import Saver
from dtensor3d.checkpoint.check import check_checkpoint
from dtensor3d.checkpoint.hf import check_hf_init, load_params
from dtensor3d.checkpoint.hf_names import HFSlices
from dtensor3d.checkpoint.resume import resume
from dtensor3d.checkpoint.slices import SliceReader
from dtensor3d.config.load import load_recipe
from dtensor3d.datasets.sources import make_source
from dtensor3d.parallel.comm import tensors_in
from dtensor3d.training.train import rank_batch, setup, train_step

GATHERS = ("gather", "broadcast", "scatter", "all_to_all", "alltoall", "send", "recv")


class Collectives(TorchDispatchMode):
    """Counts every c10d / functional collective op by name, and the elements all-reduced."""

    def __init__(self):
        super().__init__()
        self.ops, self.allreduce_elems = Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if func.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            self.ops[name] += 1
            if "allreduce" in name or "all_reduce" in name:
                self.allreduce_elems += sum(t.numel() for t in tensors_in(args))
        return func(*args, **(kwargs or {}))


def counting(fn):
    """Run fn() counting collectives and calls of DTensor.full_tensor / redistribute."""
    calls, real = Counter(), {m: getattr(DTensor, m) for m in ("full_tensor", "redistribute")}

    def wrap(m):
        def counted(self, *a, **k):
            calls[m] += 1
            return real[m](self, *a, **k)

        return counted

    for m in real:
        setattr(DTensor, m, wrap(m))
    try:
        with Collectives() as mode:
            fn()
    finally:
        for m, f in real.items():
            setattr(DTensor, m, f)
    gathers = sum(n for op, n in mode.ops.items() if any(g in op for g in GATHERS)) + sum(calls.values())
    return gathers, dict(mode.ops) | {f"DTensor.{m}": n for m, n in calls.items()}, mode.allreduce_elems


def full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()


def compare(state, model_files, optim_files):
    """(mismatched, compared): this stage's parameters and moments against the files."""
    bad, n = [], 0
    for name, p in state.model.named_parameters():
        pairs = [(name, p, model_files)]
        if optim_files is not None:
            pairs += [(f"{name}.{k}", v, optim_files) for k, v in sorted(state.optimizer.state[p].items())]
        for key, t, files in pairs:
            n += 1
            if not torch.equal(full(t).to(files.dtype(key)), files.get(key)):
                bad.append(key)
    return bad, n


def main():
    mode, path, recipe_path, *overrides = sys.argv[1:]
    recipe = load_recipe(recipe_path, overrides, world_size=int(os.environ["WORLD_SIZE"]))
    state = setup(recipe)
    if mode == "save":
        source = make_source(recipe)
        for step in range(2):
            train_step(state, rank_batch(state, source, step))  # state.step becomes 2
        saver = Saver(state)
        gathers, ops, elems = counting(lambda: saver.save(state))
        saver.wait()
        step_dir = os.path.join(path, "step_00000002")
    elif mode == "load":
        gathers, ops, elems = counting(lambda: resume(state, path))
        step_dir = path
    else:
        gathers, ops, elems = counting(lambda: load_params(state.model, HFSlices(path, check_hf_init(recipe))))
    if mode == "hf":
        bad, n = compare(state, HFSlices(path, check_hf_init(recipe)), None)
    else:
        index = check_checkpoint(step_dir, recipe.model, hashes=True)["tensors"]
        bad, n = compare(state, SliceReader(step_dir, index["model"]), SliceReader(step_dir, index["optim"]))
    placements = sorted({str(p.placements) for p in state.model.parameters() if isinstance(p, DTensor)})
    record = dict(rank=dist.get_rank(), gathers=gathers, collectives=ops, allreduce_elems=elems)
    sys.stdout.write(json.dumps(record | dict(placements=placements, mismatched=bad, compared=n)) + "\n")
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
