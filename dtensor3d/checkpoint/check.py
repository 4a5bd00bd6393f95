"""Checking a step directory against a recipe without any process group: the model config,
every tensor's slices and shapes, the optimizer state, and that a resume continues the saved
run's trajectory."""

from __future__ import annotations

import dataclasses
import math
import os

from ..config.load import recipe_from_dict
from ..config.schema import ModelConfig
from ..errors import CheckpointError, RecipeError
from ..models import build_on_meta
from .format import (
    MANIFEST,
    READS,
    STATE,
    VERSION,
    check_files,
    manifest_problem,
    read_header,
    read_json,
    read_manifest,
)
from .optim_state import BLOCK, SCALE
from .slices import full_index

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


MUON_KEYS = {"momentum_buffer"}  # training/muon.py's state of a matrix it updates
UNTRAINED = ".e_score_correction_bias"  # parameters without gradient or optimizer state (models/moe.py)


def check_optim(step_dir: str, index: dict[str, dict], expected: dict[str, list[int]]) -> None:
    """Optimizer tensors "<param>.<key>": the same keys for every trained parameter (none for
    a router's correction bias, which has no gradient; optimizer.name=muon: Muon's matrices
    have only MUON_KEYS), each of the parameter's shape or a scalar (AdamW's step), in whole slices;
    an 8-bit state's scales (optimizer.state_dtype: 8bit) one per block of BLOCK elements."""
    if not index:
        return
    keys: dict[str, set] = {name: set() for name in expected if not name.endswith(UNTRAINED)}
    for entry in index:
        param, _, key = entry.rpartition(".")
        if key.endswith(SCALE) and f"{param}.{key[: -len(SCALE)]}" in index:
            continue  # an 8-bit state's block scales (optim_state.py): only parameters whose blocks align have them
        if param not in keys:
            raise CheckpointError(
                f"{_first_file(step_dir, index[entry])}: optimizer tensor {entry} belongs to no parameter of the model"
            )
        keys[param].add(key)
    first = next((p for p, got in keys.items() if got != MUON_KEYS), next(iter(keys)))
    for param, got in keys.items():
        if got != keys[first] and got != MUON_KEYS:
            raise CheckpointError(
                f"checkpoint {step_dir}: optimizer state of {param} has {sorted(got)}, of {first} {sorted(keys[first])}"
            )
    headers: dict[str, dict] = {}
    for entry, info in index.items():
        shape, need = list(info["shape"]), expected[entry.rpartition(".")[0]]
        if entry.endswith(SCALE) and entry[: -len(SCALE)] in index:
            need = [math.prod(need) // BLOCK]
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
    ("data", "sources"),  # a mixture and the stages begun by the saved step: which source each sample came from
    ("data", "stages"),  # (a stage that begins after the saved step may be added, changed or dropped)
    ("data", "document_masking"),  # what each token attends to; absent (older checkpoints) means false
    ("optimizer", "name"),  # adamw or muon: the saved state is one's or the other's; absent (older) means adamw
)
# data.validation is not among them: it changes which windows val_loss reads, never the training samples.


def _trajectory_value(sections, section: str, key: str):
    """sections.section.key of a saved recipe dict or a Recipe; data.seed null -> training.seed,
    data.document_masking absent -> false."""

    def get(s: str, k: str):
        return (sections.get(s) or {}).get(k) if isinstance(sections, dict) else getattr(getattr(sections, s), k)

    value = get(section, key)
    if key in ("sources", "stages") and not isinstance(sections, dict):
        value = sections.to_dict()[section][key]  # as the saved record writes it
    if (section, key) == ("data", "document_masking"):
        return bool(value)
    if (section, key) == ("optimizer", "name"):
        return value or "adamw"
    return get("training", "seed") if (section, key) == ("data", "seed") and value is None else value


def check_trajectory(record: dict, recipe, where: str) -> None:
    """A resume continues the saved run: the same seed, global batch, sequence length and
    data source, and training.steps not behind the saved step (equal: nothing left to do)."""
    saved, step = record.get("recipe") or {}, int(record.get("step", 0))
    for section, key in TRAJECTORY_KEYS:
        theirs, mine = _trajectory_value(saved, section, key), _trajectory_value(recipe, section, key)
        if key == "stages":  # those begun by the saved step (start_step <= step); none: null
            theirs, mine = ([s for s in v or () if s["start_step"] <= step] or None for v in (theirs, mine))
        if key == "path" and theirs is not None and mine is not None:
            theirs, mine = os.path.normpath(theirs), os.path.normpath(mine)
        if theirs != mine:
            raise CheckpointError(
                f"checkpoint {where}: {section}.{key}={theirs!r} but the recipe has {mine!r}; a resume "
                f"continues the saved run: set {section}.{key}={theirs}, or start a new run in another "
                f"checkpoint.dir (or checkpoint.resume=none)"
            )
    if recipe.training.steps < step:
        raise CheckpointError(
            f"training.steps={recipe.training.steps} but checkpoint {where} is at step {step}; "
            f"a resume only goes forward: set training.steps above {step}"
        )
