"""The checkpoint directory: finding the newest complete step, checking a step directory
against a recipe without any process group, and the collective save.

    checkpoint.dir/
        step_00000010/
            model-stage00.safetensors   stage 0's first rank's slices of the parameters, by
                                        global name (Hugging Face LlamaForCausalLM's names)
            model-stage00-rank00001.safetensors   another rank's slices (one file per writer)
            optim-stage00[-rankNNNNN].safetensors AdamW state: "<param>.exp_avg", ".exp_avg_sq", ".step"
            state.json                  step, LR, data position, RNG, the recipe, the slice index
            manifest.json               size and sha256 of every other file; written last
        latest                          "step_00000010", replaced after the step directory exists
        LOCK                            host and pid of the run writing here (lock.py)

Saving gathers nothing: each rank writes the distinct slices it holds (slices.py: the rank at
coordinate 0 on every axis over which a tensor is replicated writes it), each slice's place
in the full tensor in its file's metadata and in state.json's index. A step directory is
written as `.tmp-step_...`, sealed with its manifest and renamed into place, so a reader
sees a whole step or none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil

import torch
import torch.distributed as dist

from ..config.load import recipe_from_dict
from ..config.lr import lr_at
from ..config.schema import ModelConfig
from ..errors import CheckpointError, RecipeError
from ..models import build_on_meta
from ..parallel.shards import local
from .format import (
    MANIFEST,
    POINTER,
    READS,
    SLICES,
    STATE,
    STEP_RE,
    VERSION,
    check_files,
    manifest_problem,
    read_header,
    read_json,
    read_manifest,
    save_tensors,
)
from .slices import Writers, boxes, full_index

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
        raise CheckpointError(
            f"{what}={path!r}: no such checkpoint (no such directory); give a step directory or a checkpoint directory"
        )
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
    record["tensors"] = index = tensor_index(step_dir, record, where)
    model_index, optim_index = index["model"], index["optim"]
    files = {s["file"] for entry in [*model_index.values(), *optim_index.values()] for s in entry["slices"]}
    unlisted = sorted(files - set(manifest["files"]))
    if unlisted:
        raise CheckpointError(f"{where} names {unlisted[0]}, which is not in {MANIFEST}; refused")
    expected = expected_shapes(cfg)
    check_index(step_dir, model_index, expected, "the recipe's model" if cfg is not saved else "the model")
    check_optim(step_dir, optim_index, expected)
    for f in dataclasses.fields(ModelConfig):
        mine, theirs = getattr(cfg, f.name), getattr(saved, f.name)
        if mine != theirs:
            raise CheckpointError(
                f"checkpoint {where}: model.{f.name}={theirs!r} but the recipe has {mine!r}; "
                f"resume with the model the checkpoint was saved with"
            )
    return record


def tensor_index(step_dir: str, record: dict, where: str) -> dict[str, dict]:
    """state.json's tensor index as slices (format 2; a format-1 index of whole tensors by
    file is read as one slice each). A format this code does not know is refused."""
    version, index = record.get("version"), record.get("tensors") or {}
    if version not in READS:
        raise CheckpointError(
            f"{where}: checkpoint format version {version!r}; this dtensor3d reads versions "
            f"{', '.join(map(str, READS))} (it writes {VERSION}); use the dtensor3d that wrote it"
        )
    if not isinstance(index, dict) or not all(isinstance(index.get(k, {}), dict) for k in ("model", "optim")):
        raise CheckpointError(f"{where}: 'tensors' must map model and optim to tensor indexes")
    if version == 1:
        return {k: full_index(step_dir, index.get(k) or {}) for k in ("model", "optim")}
    return {k: index.get(k) or {} for k in ("model", "optim")}


def _first_file(root: str, entry: dict) -> str:
    return os.path.join(root, entry["slices"][0]["file"]) if entry.get("slices") else root


def check_slices(root: str, name: str, entry: dict, headers: dict) -> None:
    """Each slice of `name` is in its file with its shape, inside the full shape, and the
    slices add up to the whole tensor (gaps and overlaps are also caught by every read)."""
    shape, total = entry["shape"], 0
    for s in entry["slices"]:
        path = os.path.join(root, s["file"])
        if path not in headers:
            headers[path] = read_header(path)
        got = headers[path].get(s["key"], {}).get("shape")
        if got != s["shape"] or len(s["offset"]) != len(shape):
            raise CheckpointError(f"{path}: tensor {s['key']} has shape {got}, its index says {s['shape']}")
        if any(o < 0 or o + n > g for o, n, g in zip(s["offset"], s["shape"], shape)):
            raise CheckpointError(f"{path}: slice {s['key']} at {s['offset']} lies outside {name}'s shape {shape}")
        total += math.prod(s["shape"])
    if total != math.prod(shape):
        raise CheckpointError(
            f"{_first_file(root, entry)}: the slices of {name} hold {total} elements, its shape {shape} has "
            f"{math.prod(shape)} (a writer's file is missing from the index?)"
        )


def check_index(root: str, index: dict[str, dict], expected: dict[str, list[int]], whose: str) -> None:
    """Every expected tensor is in the index with its shape and whole slices, and there is nothing else."""
    headers: dict[str, dict] = {}
    for name, shape in expected.items():
        if name not in index:
            raise CheckpointError(f"{root}: no tensor {name}; {whose} needs it with shape {shape}")
        if list(index[name]["shape"]) != shape:
            where = _first_file(root, index[name])
            raise CheckpointError(f"{where}: {name} has shape {index[name]['shape']}, {whose} needs {shape}")
        check_slices(root, name, index[name], headers)
    extra = sorted(set(index) - set(expected))
    if extra:
        raise CheckpointError(
            f"{_first_file(root, index[extra[0]])}: tensor {extra[0]} is not a parameter "
            f"of {whose} ({len(extra)} such tensors)"
        )


def check_optim(step_dir: str, index: dict[str, dict], expected: dict[str, list[int]]) -> None:
    """Optimizer tensors "<param>.<key>": the same keys for every parameter, each of the
    parameter's shape or a scalar (AdamW's step), in whole slices."""
    if not index:
        return
    keys: dict[str, set] = {name: set() for name in expected}
    for entry in index:
        param, _, key = entry.rpartition(".")
        if param not in keys:
            raise CheckpointError(
                f"{_first_file(step_dir, index[entry])}: optimizer tensor {entry} belongs to no parameter of the model"
            )
        keys[param].add(key)
    first = next(iter(keys))
    for param, got in keys.items():
        if got != keys[first]:
            raise CheckpointError(
                f"checkpoint {step_dir}: optimizer state of {param} has {sorted(got)}, of {first} {sorted(keys[first])}"
            )
    headers: dict[str, dict] = {}
    for entry, info in index.items():
        shape, need = list(info["shape"]), expected[entry.rpartition(".")[0]]
        if shape not in ([], need):
            raise CheckpointError(
                f"{_first_file(step_dir, info)}: optimizer tensor {entry} has shape {shape}, the model needs {need}"
            )
        check_slices(step_dir, entry, info, headers)


# The recipe keys that define a run's trajectory besides the model: a resume must keep them.
TRAJECTORY_KEYS = (
    ("training", "seed"),
    ("training", "global_batch_size"),
    ("training", "sequence_length"),
    ("data", "kind"),
    ("data", "path"),
    ("data", "seed"),  # the sample order; null means training.seed, compared as the seed it stands for
)
# data.validation is not among them: it changes which windows val_loss reads, never the training samples.


def _trajectory_value(sections, section: str, key: str):
    """sections.section.key of a saved recipe dict or a Recipe; data.seed null -> training.seed."""

    def get(s: str, k: str):
        return (sections.get(s) or {}).get(k) if isinstance(sections, dict) else getattr(getattr(sections, s), k)

    value = get(section, key)
    return get("training", "seed") if (section, key) == ("data", "seed") and value is None else value


def check_trajectory(record: dict, recipe, where: str) -> None:
    """A resume continues the saved run: the same seed, global batch, sequence length and
    data source, and training.steps not behind the saved step (equal: nothing left to do)."""
    saved = record.get("recipe") or {}
    for section, key in TRAJECTORY_KEYS:
        theirs, mine = _trajectory_value(saved, section, key), _trajectory_value(recipe, section, key)
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


@dataclasses.dataclass
class StageSlices:
    """What one rank writes: its distinct slices (safetensors key -> the local piece, no copy)
    and each slice's place, {"name", "offset", "shape" (the full tensor's)}."""

    tag: str  # the file tag: "stage00" for the stage's first rank, "stage00-rank00005" for another
    params: dict
    moments: dict
    places: dict


def _add(out: dict, places: dict, name: str, t: torch.Tensor) -> None:
    """This rank's boxes of `t` under keys `name` (one box) or `name@k`."""
    found = boxes(t, name)
    for k, (lstart, gstart, size) in enumerate(found):
        key = name if len(found) == 1 else f"{name}@{k}"
        out[key] = local(t).detach()[tuple(slice(a, a + n) for a, n in zip(lstart, size))]
        places[key] = {"name": name, "offset": list(gstart), "shape": list(t.shape)}


def stage_slices(state) -> StageSlices:
    """This rank's share of its stage's checkpoint: the pieces of each parameter and optimizer
    tensor it holds that it is the one to write (slices.Writers). Nothing is gathered and
    nothing is copied: no communication at all."""
    writers = Writers(state.recipe.parallelism.dims, state.coords)
    params, moments, places = {}, {}, {}
    for name, p in state.model.named_parameters():
        if writers.writes(p):
            _add(params, places, name, p)
        for key, value in sorted(state.optimizer.state.get(p, {}).items()):
            if torch.is_tensor(value) and writers.writes(value):
                _add(moments, places, f"{name}.{key}", value)
    lead = all(state.coords[a] == 0 for a in ("ep", "dp", "cp", "tp"))
    tag = f"stage{state.coords['pp']:02d}" + ("" if lead else f"-rank{dist.get_rank():05d}")
    return StageSlices(tag, params, moments, places)


def write_slices(tmp: str, slices: StageSlices) -> None:
    """This rank's model-<tag> and optim-<tag> files (none when it writes nothing)."""
    for kind, tensors in (("model", slices.params), ("optim", slices.moments)):
        if tensors:
            meta = {SLICES: json.dumps({k: slices.places[k] for k in tensors})}
            save_tensors(tensors, os.path.join(tmp, f"{kind}-{slices.tag}.safetensors"), meta)


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


TOKENIZER = "tokenizer.json"


def copy_tokenizer(recipe, step_tmp: str) -> None:
    """data.kind tokens over a prepared directory: its tokenizer.json into the step directory
    (before sealing, so the manifest lists it), for generate and export-hf."""
    d = recipe.data
    src = os.path.join(d.path, TOKENIZER) if d.kind == "tokens" and d.path else None
    if src and os.path.isfile(src):
        shutil.copyfile(src, os.path.join(step_tmp, TOKENIZER))
