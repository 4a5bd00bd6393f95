"""The checkpoint directory: finding the newest complete step, checking a step directory
against a recipe without any process group, and the collective save.

    checkpoint.dir/
        step_00000010/
            model-stage00.safetensors   full parameters of pipeline stage 0, by global name
                                        (Hugging Face LlamaForCausalLM's names)
            optim-stage00.safetensors   full AdamW state: "<param>.exp_avg", ".exp_avg_sq", ".step"
            state.json                  step, LR, data position, RNG, the recipe, tensor -> file
            manifest.json               size and sha256 of every other file; written last
        latest                          "step_00000010", replaced after the step directory exists
        LOCK                            host and pid of the run writing here (lock.py)

Saving gathers each parameter's full tensor (a collective over its mesh); one rank per
pipeline stage writes them. A step directory is written as `.tmp-step_...`, sealed with its
manifest and renamed into place, so a reader sees a whole step or none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time

import torch
import torch.distributed as dist

from ..errors import CheckpointError, RecipeError
from ..models import build_on_meta
from ..optim import lr_at
from ..parallel.shards import full_tensor
from ..recipe import ModelConfig, recipe_from_dict
from .format import (
    MANIFEST,
    POINTER,
    STATE,
    STEP_RE,
    check_files,
    check_tensors,
    manifest_problem,
    publish,
    read_header,
    read_json,
    read_manifest,
    save_tensors,
    seal,
    step_name,
)

# ---------------------------------------------------------------- finding checkpoints


def find_newest(ckpt_dir: str) -> tuple[str | None, list[str]]:
    """(the newest complete step directory, warnings). The pointer's step when it is
    complete, else the highest-numbered complete one. Each broken step directory newer than
    the one taken gets a warning naming it, why, and which step is taken instead; it stays."""
    names = sorted((e for e in os.listdir(ckpt_dir) if STEP_RE.match(e)), reverse=True)
    with contextlib.suppress(OSError):
        with open(os.path.join(ckpt_dir, POINTER), encoding="utf-8") as f:
            pointed = f.read().strip()
        if STEP_RE.match(pointed) and pointed in names:
            names.remove(pointed)
            names.insert(0, pointed)
    broken: list[tuple[str, str]] = []
    for name in names:
        why = manifest_problem(os.path.join(ckpt_dir, name))
        if why is None:
            taken = os.path.join(ckpt_dir, name)
            warnings = [_broken_warning(ckpt_dir, b, w, f"resuming from {name} instead") for b, w in broken]
            return taken, warnings
        broken.append((name, why))
    return None, [_broken_warning(ckpt_dir, b, w, "no complete step to resume from") for b, w in broken]


def _broken_warning(ckpt_dir: str, name: str, why: str, what: str) -> str:
    return f"warning: checkpoint {os.path.join(ckpt_dir, name)} is broken ({why}); {what}; it is left in place"


def newest(ckpt_dir: str) -> str | None:
    """The newest complete step directory of `ckpt_dir` (see find_newest), or None."""
    return find_newest(ckpt_dir)[0]


def resolve(path: str, what: str) -> str:
    """A step directory, or a checkpoint directory meaning its newest complete step."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{what}={path!r}: no such directory; give a step directory or a checkpoint directory")
    if STEP_RE.match(os.path.basename(os.path.normpath(path))) or os.path.exists(os.path.join(path, MANIFEST)):
        why = manifest_problem(path)
        if why is not None:
            raise CheckpointError(
                f"{what}={path!r} is incomplete: {why} (an interrupted save?); give a complete step directory"
            )
        return path
    found = newest(path)
    if found is None:
        raise CheckpointError(
            f"{what}={path!r} holds no complete checkpoint (a step_NNNNNNNN directory with a {MANIFEST})"
        )
    return found


def resume_dir(recipe) -> str | None:
    """The step directory a run resumes from, or None for a fresh start."""
    return resume_target(recipe)[0]


def resume_target(recipe) -> tuple[str | None, list[str]]:
    """(the step directory a run resumes from or None, warnings about broken newer steps)."""
    c = recipe.checkpoint
    if c.resume == "none":
        return None, []
    if c.resume == "auto":
        return find_newest(c.dir) if c.dir and os.path.isdir(c.dir) else (None, [])
    return resolve(c.resume, "checkpoint.resume"), []


# ---------------------------------------------------------------- checking a step directory


def expected_shapes(cfg) -> dict[str, list[int]]:
    """The full shape of every parameter of LlamaForCausalLM(cfg), by name (built on meta)."""
    return {name: list(p.shape) for name, p in build_on_meta(cfg).named_parameters()}


def model_config(record: dict, where: str) -> ModelConfig:
    try:
        return recipe_from_dict({"model": record["recipe"]["model"]}).model
    except (KeyError, TypeError, RecipeError) as e:
        raise CheckpointError(f"{where}: no valid recipe.model ({e})") from None


def check_checkpoint(step_dir: str, cfg, hashes: bool) -> dict:
    """Everything about a step directory that needs no process group, against the model
    `cfg` (None: the checkpoint's own). Returns its state.json; raises CheckpointError naming
    the file and what differs."""
    why = manifest_problem(step_dir)
    if why is not None:
        raise CheckpointError(f"checkpoint {step_dir} is incomplete: {why}")
    manifest = read_manifest(step_dir)
    check_files(step_dir, manifest["files"], hashes)
    where = os.path.join(step_dir, STATE)
    record = read_json(where, "checkpoint file")
    saved = model_config(record, where)
    cfg = cfg or saved
    index = record.get("tensors") or {}
    model_index, optim_index = index.get("model") or {}, index.get("optim") or {}
    unlisted = sorted((set(model_index.values()) | set(optim_index.values())) - set(manifest["files"]))
    if unlisted:
        raise CheckpointError(f"{where} names {unlisted[0]}, which is not in {MANIFEST}; refused")
    expected = expected_shapes(cfg)
    check_tensors(step_dir, model_index, expected, "the recipe's model" if cfg is not saved else "the model")
    check_optim(step_dir, optim_index, expected)
    for f in dataclasses.fields(ModelConfig):
        mine, theirs = getattr(cfg, f.name), getattr(saved, f.name)
        if mine != theirs:
            raise CheckpointError(
                f"checkpoint {where}: model.{f.name}={theirs!r} but the recipe has {mine!r}; "
                f"resume with the model the checkpoint was saved with"
            )
    return record


def check_optim(step_dir: str, index: dict[str, str], expected: dict[str, list[int]]) -> None:
    """Optimizer tensors "<param>.<key>": the same keys for every parameter, each of the
    parameter's shape or a scalar (AdamW's step)."""
    if not index:
        return
    keys: dict[str, set] = {name: set() for name in expected}
    for entry in index:
        param, _, key = entry.rpartition(".")
        if param not in keys:
            path = os.path.join(step_dir, index[entry])
            raise CheckpointError(f"{path}: optimizer tensor {entry} belongs to no parameter of the model")
        keys[param].add(key)
    first = next(iter(keys))
    for param, got in keys.items():
        if got != keys[first]:
            raise CheckpointError(
                f"checkpoint {step_dir}: optimizer state of {param} has {sorted(got)}, of {first} {sorted(keys[first])}"
            )
    headers: dict[str, dict] = {}
    for entry, file in index.items():
        path = os.path.join(step_dir, file)
        headers.setdefault(path, read_header(path))
        shape, need = headers[path].get(entry, {}).get("shape"), expected[entry.rpartition(".")[0]]
        if shape not in ([], need):
            raise CheckpointError(f"{path}: optimizer tensor {entry} has shape {shape}, the model needs {need}")


# The recipe keys that define a run's trajectory besides the model: a resume must keep them.
TRAJECTORY_KEYS = (
    ("training", "seed"),
    ("training", "global_batch_size"),
    ("training", "sequence_length"),
    ("data", "kind"),
    ("data", "path"),
)


def check_trajectory(record: dict, recipe, where: str) -> None:
    """A resume continues the saved run: the same seed, global batch, sequence length and
    data source, and training.steps not behind the saved step (equal: nothing left to do)."""
    saved = record.get("recipe") or {}
    for section, key in TRAJECTORY_KEYS:
        theirs, mine = (saved.get(section) or {}).get(key), getattr(getattr(recipe, section), key)
        if key == "path" and theirs is not None and mine is not None:
            theirs, mine = os.path.normpath(theirs), os.path.normpath(mine)
        if theirs != mine:
            raise CheckpointError(
                f"checkpoint {where}: {section}.{key}={theirs!r} but the recipe has {mine!r}; a resume "
                f"continues the saved run: set {section}.{key}={theirs}, or start a new run in another "
                f"checkpoint.dir (or checkpoint.resume=none)"
            )
    step = int(record.get("step", 0))
    if recipe.training.steps < step:
        raise CheckpointError(
            f"training.steps={recipe.training.steps} but checkpoint {where} is at step {step}; "
            f"a resume only goes forward: set training.steps above {step}"
        )


# ---------------------------------------------------------------- saving


def checkpoint_due(recipe, step: int) -> bool:
    c = recipe.checkpoint
    return bool(c.dir) and (step == recipe.training.steps or (c.interval > 0 and step % c.interval == 0))


def gather_stage(state) -> tuple[dict, dict]:
    """Full parameters and optimizer state of this rank's stage. Every rank of a stage
    calls `full_tensor` in the same order; only the writer keeps what it gathers."""
    keep = all(state.coords[a] == 0 for a in ("ep", "dp", "cp", "tp"))
    params, moments = {}, {}
    for name, p in state.model.named_parameters():
        full = full_tensor(p)
        if keep:
            params[name] = full
        for key, value in sorted(state.optimizer.state.get(p, {}).items()):
            full = full_tensor(value)
            if keep:
                moments[f"{name}.{key}"] = full
    return (params, moments) if keep else ({}, {})


def state_record(state) -> dict:
    r = state.recipe
    rng = {"cpu": torch.get_rng_state().tolist()}
    if state.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(state.device).tolist()
    return {
        "step": state.step,
        "next_lr": lr_at(state.step, r.optimizer, r.training.steps),
        "data": {
            "kind": r.data.kind,
            "path": r.data.path,
            "seed": r.training.seed,
            "samples_consumed": state.step * r.training.global_batch_size,
        },
        "rng": rng,
        "mesh": r.parallelism.dims,
        "recipe": r.to_dict(),
    }


def prune(ckpt_dir: str, step: int, keep: int) -> None:
    """Keep the newest `keep` complete step directories up to `step`; drop leftover temporaries."""
    done = sorted(
        e
        for e in os.listdir(ckpt_dir)
        if STEP_RE.match(e) and int(e[5:]) <= step and read_manifest(os.path.join(ckpt_dir, e))
    )
    for name in done[:-keep]:
        shutil.rmtree(os.path.join(ckpt_dir, name))
    for e in os.listdir(ckpt_dir):
        if e.startswith(".tmp-step_"):
            shutil.rmtree(os.path.join(ckpt_dir, e), ignore_errors=True)


def save(state) -> str:
    """Write checkpoint `state.step` into checkpoint.dir. Every rank calls this."""
    c, rank, start = state.recipe.checkpoint, dist.get_rank(), time.perf_counter()
    name = step_name(state.step)
    tmp = os.path.join(c.dir, f".tmp-{name}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    params, moments = gather_stage(state)
    stage = state.coords["pp"]
    if params:
        save_tensors(params, os.path.join(tmp, f"model-stage{stage:02d}.safetensors"))
    if moments:
        save_tensors(moments, os.path.join(tmp, f"optim-stage{stage:02d}.safetensors"))
    dist.barrier()
    final = os.path.join(c.dir, name)
    if rank == 0:
        seal(tmp, state_record(state))
        publish(c.dir, tmp, name)
        prune(c.dir, state.step, c.keep)
        size = sum(os.path.getsize(os.path.join(final, f)) for f in os.listdir(final))
        print(f"checkpoint: saved {final} ({size / 1e6:.2f} MB) in {time.perf_counter() - start:.2f} s", flush=True)
    dist.barrier()
    return final
