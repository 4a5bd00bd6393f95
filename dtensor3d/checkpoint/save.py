"""What a save writes (checkpoint/background.py's Saver writes it): this rank's slices of its
stage (nothing gathered), the state record each part of the run contributes, the tokenizer,
and pruning old steps."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import torch
import torch.distributed as dist

from ..config.data_sources import mixtures_of
from ..config.lr import lr_at
from ..datasets.sources import data_position
from ..models import stored_name
from ..parallel.shards import local
from .format import (
    SLICES,
    STEP_RE,
    read_manifest,
    save_tensors,
)
from .optim_state import add_state
from .slices import Writers, boxes

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


def _add(out: dict, places: dict, name: str, t: torch.Tensor, piece=None, found=None) -> None:
    """This rank's boxes of `t` under keys `name` (one box) or `name@k`; `piece` and `found`:
    the local tensor and its boxes when they are not t's own (an 8-bit state's codes and scales)."""
    found = boxes(t, name) if found is None else found
    piece = local(t).detach() if piece is None else piece
    for k, (lstart, gstart, size) in enumerate(found):
        key = name if len(found) == 1 else f"{name}@{k}"
        out[key] = piece[tuple(slice(a, a + n) for a, n in zip(lstart, size))]
        places[key] = {"name": name, "offset": list(gstart), "shape": list(t.shape)}


def stage_slices(state) -> StageSlices:
    """This rank's share of its stage's checkpoint: the pieces of each parameter and optimizer
    tensor it holds that it is the one to write (slices.Writers). Nothing is gathered and
    nothing is copied: no communication at all."""
    writers = Writers(state.recipe.parallelism.dims, state.coords)
    params, moments, places = {}, {}, {}
    for name, p in state.model.named_parameters():
        if stored_name(state.model.cfg, name) != name:
            continue  # a tied head's copy (the last pipeline stage's): the first stage saves the matrix
        if writers.writes(p):
            _add(params, places, name, p)
        for key, value in sorted(state.optimizer.state.get(p, {}).items()):
            if torch.is_tensor(value) and writers.writes(value):  # bf16 / 8-bit states as they are: optim_state.py
                add_state(lambda *a: _add(moments, places, *a), f"{name}.{key}", value)
    lead = all(state.coords[a] == 0 for a in ("ep", "dp", "cp", "tp"))
    tag = f"stage{state.coords['pp']:02d}" + ("" if lead else f"-rank{dist.get_rank():05d}")
    return StageSlices(tag, params, moments, places)


def write_slices(tmp: str, slices: StageSlices) -> None:
    """This rank's model-<tag> and optim-<tag> files (none when it writes nothing)."""
    for kind, tensors in (("model", slices.params), ("optim", slices.moments)):
        if tensors:
            meta = {SLICES: json.dumps({k: slices.places[k] for k in tensors})}
            save_tensors(tensors, os.path.join(tmp, f"{kind}-{slices.tag}.safetensors"), meta)


def rng_record(device: torch.device) -> dict:
    """The random generators' state (CPU, and this device's under CUDA)."""
    rng = {"cpu": torch.get_rng_state().tolist()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device).tolist()
    return rng


def state_record(state) -> dict:
    """state.json's record of a step: each part of the run contributes its own piece (the
    schedule its step and next lr, the data its position, the generators their state, the
    mesh and the recipe themselves), from the TrainState's public fields only."""
    r = state.recipe
    return {
        "step": state.step,
        "next_lr": lr_at(state.step - state.held_steps, r.optimizer, r.training.steps),
        "data": data_position(r, state.step),
        "rng": rng_record(state.device),
        "mesh": r.parallelism.dims,
        "recipe": r.to_dict(),
        "held_steps": state.held_steps,  # steps skipped with the lr schedule held (training/skip.py)
        **({"spike_window": state.spikes.to_record()} if state.spikes is not None else {}),
        **({"wandb_id": state.wandb_id} if state.wandb_id else {}),  # logging.wandb: a resume continues the run
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
CHAT_TEMPLATE = "chat_template.jinja"


def copy_tokenizer(recipe, step_tmp: str) -> None:
    """data.kind tokens over a prepared directory: its tokenizer.json into the step directory
    (before sealing, so the manifest lists it), for generate and export-hf; the chat template
    of data prepared with --chat as tokenizer_config.json's `chat_template` (a step directory
    holds safetensors and JSON only)."""
    d = recipe.data
    mixtures = mixtures_of(d)  # data.path, or a mixture's first source: they share one tokenizer (the door)
    folder = mixtures[0][1][0].path if d.kind == "tokens" and mixtures else None
    if folder and os.path.isfile(os.path.join(folder, TOKENIZER)):
        shutil.copyfile(os.path.join(folder, TOKENIZER), os.path.join(step_tmp, TOKENIZER))
    if folder and os.path.isfile(os.path.join(folder, CHAT_TEMPLATE)):
        template_into_config(os.path.join(folder, CHAT_TEMPLATE), step_tmp)


def template_into_config(template: str, step_tmp: str) -> None:
    """A chat_template.jinja as `chat_template` of the step directory's tokenizer_config.json
    (added to the one there, if any), where transformers and generate --chat also look."""
    config_file = os.path.join(step_tmp, "tokenizer_config.json")
    config = {}
    if os.path.isfile(config_file):
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    with open(template, encoding="utf-8") as f:
        config["chat_template"] = f.read()
    with open(config_file, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
        f.write("\n")
