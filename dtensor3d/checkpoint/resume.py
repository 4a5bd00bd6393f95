"""How a run starts from disk: the load in setup (resume from a step directory, or Hugging Face
init); the checks at the door, before any process group, are dir_check.py's.

Loading reads, for each tensor, only the regions of the full tensor this rank's piece covers
(slices.read_into_: safetensors get_slice on the saved slices that intersect them), so a
checkpoint resumes at any mesh and no rank holds more than its own shards plus one region.
The ranks split the sha256 checks between them.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from ..config.lr import keep_curve_advice, lr_at
from ..errors import RESIZE_CAUSE, CheckpointError, UserError, is_rank0
from ..models import stored_name
from .check import check_checkpoint, check_trajectory
from .find import resume_target
from .format import STATE, corrupt, read_manifest, sha256_file
from .hf import check_hf_init, load_params
from .hf_names import HFSlices
from .optim_state import SCALE, load_state, new_state
from .slices import SliceReader


def load_optimizer(optimizer, model: torch.nn.Module, files: SliceReader) -> None:
    """Rebuild the optimizer state of this rank's parameters, reading only its pieces, each
    state in the optimizer's own dtype (optimizer.state_dtype; checkpoint/optim_state.py)."""
    keys: dict[str, list[str]] = {}
    for entry in files.index:
        param, _, key = entry.rpartition(".")
        if not (key.endswith(SCALE) and f"{param}.{key[: -len(SCALE)]}" in files.index):  # an 8-bit state's scales
            keys.setdefault(param, []).append(key)
    for name, p in model.named_parameters():
        name, entry = stored_name(model.cfg, name), {}  # a tied head's copy: the embedding's moments
        for key in sorted(keys.get(name, [])):
            if not files.shape(f"{name}.{key}"):  # AdamW's step counter, kept on the CPU as AdamW keeps it
                entry[key] = files.read(f"{name}.{key}")
            else:
                entry[key] = new_state(optimizer, p, key)
                load_state(entry[key], f"{name}.{key}", files)
        if entry:
            optimizer.state[p] = entry


def verify_hashes(step_dir: str, files: dict) -> None:
    """sha256 of every manifest file, split over the ranks; every rank raises the same error."""
    names, rank, world = sorted(files), dist.get_rank(), dist.get_world_size()
    bad = torch.zeros(len(names), dtype=torch.int32)
    for i in range(rank, len(names), world):
        bad[i] = sha256_file(os.path.join(step_dir, names[i])) != files[names[i]]["sha256"]
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bad.any():
        raise CheckpointError(corrupt(os.path.join(step_dir, names[int(bad.nonzero()[0])])))


def note_grown_steps(record: dict, recipe) -> None:
    """One `note:` line when training.steps grew since the save: the LR schedule's decay is
    recomputed for the new length, so the next step's lr may leave the saved run's curve; the
    line says which decay_start / decay_steps keep it (config/lr.keep_curve_advice). Steps are
    numbered as metrics.jsonl numbers them (1-based: the record's step is the count done)."""
    saved_recipe = record.get("recipe") or {}
    saved = (saved_recipe.get("training") or {}).get("steps")
    step, steps = int(record["step"]), recipe.training.steps
    if saved is None or steps <= saved or "next_lr" not in record:
        return
    lr = lr_at(step, recipe.optimizer, steps)
    advice = keep_curve_advice(recipe.optimizer, saved_recipe.get("optimizer") or {}, saved, steps, step)
    print(
        f"note: training.steps grew from {saved} to {steps}: the LR schedule is recomputed for {steps} steps, so "
        f"step {step + 1} runs at lr {lr:.3e} where the saved run's next_lr was {record['next_lr']:.3e}; {advice}",
        file=sys.stderr,
        flush=True,
    )


def resize_line(saved_recipe: dict, recipe, cause: str | None) -> str | None:
    """`resized: dp 4 -> 2 (node 1 lost), global batch 16 kept, 2 -> 4 microbatches per rank` when the
    run resumes at another data-parallel size (an elastic job's new world: launch/elastic.py)."""
    par, tr = saved_recipe.get("parallelism") or {}, saved_recipe.get("training") or {}
    dp, p = par.get("dp"), recipe.parallelism
    if dp is None or dp == p.dp:
        return None
    saved_micro = tr["global_batch_size"] // (tr["micro_batch_size"] * par.get("ep", 1) * dp)
    why = f" ({cause})" if cause else ""
    return (
        f"resized: dp {dp} -> {p.dp}{why}, global batch {recipe.training.global_batch_size} kept, "
        f"{saved_micro} -> {recipe.num_microbatches} microbatches per rank"
    )


def resume(state, step_dir: str) -> None:
    """Model, optimizer, step and RNG of `state` from a step directory."""
    record = check_checkpoint(step_dir, state.recipe.model, hashes=False)
    if "source" not in record:
        check_trajectory(record, state.recipe, os.path.join(step_dir, STATE))
    verify_hashes(step_dir, read_manifest(step_dir)["files"])
    index = record["tensors"]
    load_params(state.model, SliceReader(step_dir, index["model"]))
    load_optimizer(state.optimizer, state.model, SliceReader(step_dir, index["optim"]))
    state.step = int(record["step"])
    state.held_steps = int(record.get("held_steps", 0))  # training.skip_spikes (training/skip.py)
    state.wandb_id = record.get("wandb_id")  # logging.wandb: the same W&B run goes on
    if state.spikes is not None:
        state.spikes.load(record.get("spike_window"))
    if is_rank0():
        note_grown_steps(record, state.recipe)
        line = resize_line(record.get("recipe") or {}, state.recipe, os.environ.get(RESIZE_CAUSE))
        if line:
            print(line, file=sys.stderr, flush=True)
    rng = record.get("rng") or {}
    if "cpu" in rng:
        torch.set_rng_state(torch.tensor(rng["cpu"], dtype=torch.uint8))
    if "cuda" in rng and state.device.type == "cuda":
        torch.cuda.set_rng_state(torch.tensor(rng["cuda"], dtype=torch.uint8), state.device)


def load_at_start(state) -> None:
    """In setup: resume from checkpoint.resume, or else start from checkpoint.init_from_hf."""
    recipe, start = state.recipe, time.perf_counter()
    try:
        step_dir, _ = resume_target(recipe)
        if step_dir:
            resume(state, step_dir)
            what = f"resumed from {step_dir} at step {state.step}"
        elif recipe.checkpoint.init_from_hf:
            hf_dir = recipe.checkpoint.init_from_hf
            load_params(state.model, HFSlices(hf_dir, check_hf_init(recipe), recipe.model.family))
            what = f"initialised from Hugging Face weights {hf_dir}"
        else:
            return
    except UserError:
        dist.destroy_process_group()
        raise
    if is_rank0():
        print(f"checkpoint: {what} in {time.perf_counter() - start:.2f} s", flush=True)
        if state.step >= recipe.training.steps:
            print(f"checkpoint: step {state.step} is training.steps={recipe.training.steps}: nothing left to train")
