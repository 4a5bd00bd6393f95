"""Checkpoints: safetensors and JSON only, written atomically, resumable at any mesh, and
Hugging Face Llama import / export.

A checkpoint directory (`checkpoint.dir`) holds step directories and a pointer:

    step_00000010/
        model-stage00.safetensors   full parameters of pipeline stage 0, by global name
                                    (Hugging Face LlamaForCausalLM's names)
        optim-stage00.safetensors   full AdamW state: "<param>.exp_avg", ".exp_avg_sq", ".step"
        state.json                  step, LR, data position, RNG, the recipe, tensor -> file
        manifest.json               size and sha256 of every other file; written last
    latest                          "step_00000010", replaced after the step directory exists

Saving gathers each parameter's full tensor (`full_tensor()`, a collective over its mesh);
one rank per pipeline stage writes them. Loading reads the full tensors this rank's stage
needs and keeps its slice: the path of the topology-independent init, so a checkpoint
resumes at any mesh. A step directory is written as `.tmp-step_...` and renamed when
complete. Only files named in the manifest are opened, only as safetensors or JSON:
nothing is ever unpickled. Every rank (and one process per job: the CLI's `validate`) can
check a checkpoint before any process group starts (`check_at_door`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import struct
import time

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, distribute_tensor

from .models.llama import LlamaForCausalLM
from .optim import lr_at
from .recipe import ModelConfig, Recipe, RecipeError, recipe_from_dict

FORMAT, VERSION = "dtensor3d-checkpoint", 1
MANIFEST, STATE, POINTER = "manifest.json", "state.json", "latest"
STEP_RE = re.compile(r"^step_(\d{8})$")
HF_SINGLE, HF_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Hugging Face LlamaConfig's defaults, for keys a config.json leaves out.
HF_DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
# ModelConfig fields that a Llama config.json holds under the same name.
LLAMA_KEYS = (*HF_DEFAULTS, "num_key_value_heads", "rope_theta")
# ...and the ones a Mixtral config.json adds (with MixtralConfig's defaults).
MIXTRAL_DEFAULTS = {"num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001}
# Our stacked experts [E, in, out] <-> Mixtral's one Linear weight [out, in] per expert.
EXPERTS_RE = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(w[123])$")


# ---------------------------------------------------------------- files and headers


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def read_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise RecipeError(f"{what} {path} is missing") from None
    except (OSError, ValueError) as e:
        raise RecipeError(f"{what} {path} is not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{what} {path} must hold a JSON object")
    return data


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, text: str) -> None:
    """Write a small text file by tmp + fsync + rename: readers see the old or the new one."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _save_tensors(tensors: dict, path: str) -> None:
    save_file(tensors, path, metadata={"format": "pt"})
    _fsync(path)


def read_header(path: str) -> dict[str, dict]:
    """A safetensors file's table {name: {dtype, shape, data_offsets}}, read without any
    tensor. A missing file, a bad header or a file shorter than its header says: RecipeError."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 <= n <= size - 8:
                raise RecipeError(f"{path} is truncated or not a safetensors file ({size} bytes)")
            table = json.loads(f.read(n))
        table.pop("__metadata__", None)
        end = max((int(t["data_offsets"][1]) for t in table.values()), default=0)
        shapes = {k: list(t["shape"]) for k, t in table.items()}
    except FileNotFoundError:
        raise RecipeError(f"{path} is missing") from None
    except (AttributeError, KeyError, TypeError, ValueError, IndexError):
        raise RecipeError(f"{path} is not a safetensors file (unreadable header)") from None
    if 8 + n + end > size:
        raise RecipeError(f"{path} is truncated: its header describes {8 + n + end} bytes, the file has {size}")
    return {k: dict(table[k], shape=shapes[k]) for k in table}


class TensorFiles:
    """Full tensors by name from safetensors files under `root`; each file opened once, lazily."""

    def __init__(self, root: str, index: dict[str, str]):
        self.root, self.index, self.handles = root, index, {}
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> TensorFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()

    def get(self, name: str) -> torch.Tensor:
        file = self.index[name]
        if file not in self.handles:
            path = os.path.join(self.root, file)
            self.handles[file] = self.stack.enter_context(safe_open(path, framework="pt", device="cpu"))
        return self.handles[file].get_tensor(name)


def hf_shapes(cfg) -> dict[str, list[int]]:
    """Parameter shapes by Hugging Face name: ours, except Mixtral's experts one by one."""
    out = {}
    for name, shape in expected_shapes(cfg).items():
        m = EXPERTS_RE.match(name)
        if m:
            out.update({f"{m[1]}.{e}.{m[2]}.weight": [shape[2], shape[1]] for e in range(shape[0])})
        else:
            out[name] = shape
    return out


def to_hf(name: str, full: torch.Tensor) -> dict[str, torch.Tensor]:
    """One of our full tensors as Hugging Face tensors (stacked experts split and transposed)."""
    m = EXPERTS_RE.match(name)
    if not m:
        return {name: full}
    return {f"{m[1]}.{e}.{m[2]}.weight": w.T.contiguous() for e, w in enumerate(full.unbind(0))}


class HFTensorFiles(TensorFiles):
    """Our tensors by our names from a Hugging Face directory (Mixtral experts stacked)."""

    def get(self, name: str) -> torch.Tensor:
        m = EXPERTS_RE.match(name)
        if not m:
            return super().get(name)
        count = sum(1 for n in self.index if n.startswith(m[1] + ".") and n.endswith(f".{m[2]}.weight"))
        return torch.stack([TensorFiles.get(self, f"{m[1]}.{e}.{m[2]}.weight").T for e in range(count)])


def expected_shapes(cfg) -> dict[str, list[int]]:
    """The full shape of every parameter of LlamaForCausalLM(cfg), by name (built on meta)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return {name: list(p.shape) for name, p in model.named_parameters()}


def check_tensors(root: str, index: dict[str, str], expected: dict[str, list[int]], whose: str = "the model") -> None:
    """Every expected tensor is in its file with its shape, and there is nothing else."""
    headers: dict[str, dict] = {}
    for name, shape in expected.items():
        if name not in index:
            raise RecipeError(f"{root}: no tensor {name}; {whose} needs it with shape {shape}")
        path = os.path.join(root, index[name])
        if path not in headers:
            headers[path] = read_header(path)
        entry = headers[path].get(name)
        if entry is None:
            raise RecipeError(f"{path}: no tensor {name} (its index says it is there)")
        if entry["shape"] != shape:
            raise RecipeError(f"{path}: {name} has shape {entry['shape']}, {whose} needs {shape}")
    extra = sorted(set(index) - set(expected))
    if extra:
        raise RecipeError(
            f"{os.path.join(root, index[extra[0]])}: tensor {extra[0]} is not a parameter "
            f"of {whose} ({len(extra)} such tensors)"
        )


# ---------------------------------------------------------------- finding checkpoints


def read_manifest(step_dir: str) -> dict | None:
    """The manifest of a complete step directory; None when it has none (an interrupted save)."""
    try:
        with open(os.path.join(step_dir, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    ok = manifest.get("format") == FORMAT if isinstance(manifest, dict) else False
    return manifest if ok and isinstance(files, dict) and STATE in files else None


def newest(ckpt_dir: str) -> str | None:
    """The newest complete step directory: the pointer's, else the highest-numbered complete."""
    with contextlib.suppress(OSError):
        with open(os.path.join(ckpt_dir, POINTER), encoding="utf-8") as f:
            name = f.read().strip()
        if STEP_RE.match(name) and read_manifest(os.path.join(ckpt_dir, name)):
            return os.path.join(ckpt_dir, name)
    names = sorted((e for e in os.listdir(ckpt_dir) if STEP_RE.match(e)), reverse=True)
    return next((os.path.join(ckpt_dir, n) for n in names if read_manifest(os.path.join(ckpt_dir, n))), None)


def resolve(path: str, what: str) -> str:
    """A step directory, or a checkpoint directory meaning its newest complete step."""
    if not os.path.isdir(path):
        raise RecipeError(f"{what}={path!r}: no such directory; give a step directory or a checkpoint directory")
    if STEP_RE.match(os.path.basename(os.path.normpath(path))) or os.path.exists(os.path.join(path, MANIFEST)):
        if read_manifest(path) is None:
            raise RecipeError(
                f"{what}={path!r} is incomplete: no readable {MANIFEST} (an interrupted save?); "
                f"give a complete step directory"
            )
        return path
    found = newest(path)
    if found is None:
        raise RecipeError(f"{what}={path!r} holds no complete checkpoint (a step_NNNNNNNN directory with a {MANIFEST})")
    return found


def resume_dir(recipe) -> str | None:
    """The step directory a run resumes from, or None for a fresh start."""
    c = recipe.checkpoint
    if c.resume == "none":
        return None
    if c.resume == "auto":
        return newest(c.dir) if c.dir and os.path.isdir(c.dir) else None
    return resolve(c.resume, "checkpoint.resume")


# ---------------------------------------------------------------- checking


def check_files(step_dir: str, files: dict, hashes: bool) -> None:
    """Each manifest file is there with its size (and, if `hashes`, its sha256)."""
    for name in sorted(files):
        if os.path.basename(name) != name or not name.endswith((".safetensors", ".json")):
            raise RecipeError(
                f"{os.path.join(step_dir, MANIFEST)} lists {name!r}; only safetensors and "
                f"JSON files in the step directory are loaded"
            )
    for name, info in sorted(files.items()):
        path = os.path.join(step_dir, name)
        if not os.path.isfile(path):
            raise RecipeError(f"checkpoint file {path} is missing (listed in {MANIFEST})")
        size = os.path.getsize(path)
        if size != info.get("bytes"):
            raise RecipeError(
                f"checkpoint file {path} has {size} bytes, {MANIFEST} says {info.get('bytes')} (truncated or changed)"
            )
        if hashes and sha256_file(path) != info.get("sha256"):
            raise RecipeError(_corrupt(path))


def _corrupt(path: str) -> str:
    return f"checkpoint file {path}: sha256 differs from {MANIFEST}'s (the file is corrupt or was changed)"


def _model_config(record: dict, where: str) -> ModelConfig:
    try:
        return recipe_from_dict({"model": record["recipe"]["model"]}).model
    except (KeyError, TypeError, RecipeError) as e:
        raise RecipeError(f"{where}: no valid recipe.model ({e})") from None


def check_checkpoint(step_dir: str, cfg, hashes: bool) -> dict:
    """Everything about a step directory that needs no process group, against the model
    `cfg` (None: the checkpoint's own). Returns its state.json; raises RecipeError naming
    the file and what differs."""
    manifest = read_manifest(step_dir)
    if manifest is None:
        raise RecipeError(f"checkpoint {step_dir} is incomplete: no readable {MANIFEST}")
    check_files(step_dir, manifest["files"], hashes)
    where = os.path.join(step_dir, STATE)
    record = read_json(where, "checkpoint file")
    saved = _model_config(record, where)
    cfg = cfg or saved
    index = record.get("tensors") or {}
    model_index, optim_index = index.get("model") or {}, index.get("optim") or {}
    unlisted = sorted((set(model_index.values()) | set(optim_index.values())) - set(manifest["files"]))
    if unlisted:
        raise RecipeError(f"{where} names {unlisted[0]}, which is not in {MANIFEST}; refused")
    expected = expected_shapes(cfg)
    check_tensors(step_dir, model_index, expected, "the recipe's model" if cfg is not saved else "the model")
    _check_optim(step_dir, optim_index, expected)
    for f in dataclasses.fields(ModelConfig):
        mine, theirs = getattr(cfg, f.name), getattr(saved, f.name)
        if mine != theirs:
            raise RecipeError(
                f"checkpoint {where}: model.{f.name}={theirs!r} but the recipe has {mine!r}; "
                f"resume with the model the checkpoint was saved with"
            )
    return record


def _check_optim(step_dir: str, index: dict[str, str], expected: dict[str, list[int]]) -> None:
    """Optimizer tensors "<param>.<key>": the same keys for every parameter, each of the
    parameter's shape or a scalar (AdamW's step)."""
    if not index:
        return
    keys: dict[str, set] = {name: set() for name in expected}
    for entry in index:
        param, _, key = entry.rpartition(".")
        if param not in keys:
            raise RecipeError(
                f"{os.path.join(step_dir, index[entry])}: optimizer tensor {entry} belongs to no parameter of the model"
            )
        keys[param].add(key)
    first = next(iter(keys))
    for param, got in keys.items():
        if got != keys[first]:
            raise RecipeError(
                f"checkpoint {step_dir}: optimizer state of {param} has {sorted(got)}, of {first} {sorted(keys[first])}"
            )
    headers: dict[str, dict] = {}
    for entry, file in index.items():
        path = os.path.join(step_dir, file)
        headers.setdefault(path, read_header(path))
        shape = headers[path].get(entry, {}).get("shape")
        if shape not in ([], expected[entry.rpartition(".")[0]]):
            raise RecipeError(
                f"{path}: optimizer tensor {entry} has shape {shape}, the model needs "
                f"{expected[entry.rpartition('.')[0]]}"
            )


def check_at_door(recipe, hashes: bool) -> None:
    """The checks before any process group: the checkpoint a run resumes from, or else its
    `init_from_hf` directory. `hashes`: also verify every file's sha256 here."""
    step_dir = resume_dir(recipe)
    if step_dir:
        check_checkpoint(step_dir, recipe.model, hashes)
    elif recipe.checkpoint.init_from_hf:
        check_hf_init(recipe)


# ---------------------------------------------------------------- saving


def checkpoint_due(recipe, step: int) -> bool:
    c = recipe.checkpoint
    return bool(c.dir) and (step == recipe.training.steps or (c.interval > 0 and step % c.interval == 0))


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU (a collective over its mesh when it is a DTensor)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().contiguous()


def _gather_stage(state) -> tuple[dict, dict]:
    """Full parameters and optimizer state of this rank's stage. Every rank of a stage
    calls `full_tensor` in the same order; only the writer keeps what it gathers."""
    keep = all(state.coords[a] == 0 for a in ("ep", "dp", "cp", "tp"))
    params, moments = {}, {}
    for name, p in state.model.named_parameters():
        full = _full(p)
        if keep:
            params[name] = full
        for key, value in sorted(state.optimizer.state.get(p, {}).items()):
            full = _full(value)
            if keep:
                moments[f"{name}.{key}"] = full
    return (params, moments) if keep else ({}, {})


def _state_record(state) -> dict:
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


def seal(step_tmp: str, record: dict) -> None:
    """Finish a step directory: state.json (with the tensor -> file index), then the manifest."""
    index: dict[str, dict] = {"model": {}, "optim": {}}
    for file in sorted(os.listdir(step_tmp)):
        if file.endswith(".safetensors"):
            kind = "optim" if file.startswith("optim-") else "model"
            index[kind].update({name: file for name in read_header(os.path.join(step_tmp, file))})
    record = {"format": FORMAT, "version": VERSION, **record, "tensors": index}
    _write_atomic(os.path.join(step_tmp, STATE), json.dumps(record, indent=1))
    files = {
        f: {"bytes": os.path.getsize(os.path.join(step_tmp, f)), "sha256": sha256_file(os.path.join(step_tmp, f))}
        for f in sorted(os.listdir(step_tmp))
    }
    _write_atomic(
        os.path.join(step_tmp, MANIFEST), json.dumps({"format": FORMAT, "version": VERSION, "files": files}, indent=1)
    )
    _fsync(step_tmp)


def publish(ckpt_dir: str, step_tmp: str, name: str) -> str:
    """Rename a sealed step directory into place (replacing one of the same step), then
    point `latest` at it."""
    final = os.path.join(ckpt_dir, name)
    if os.path.exists(final):
        old = os.path.join(ckpt_dir, f".old-{name}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(step_tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(step_tmp, final)
    _fsync(ckpt_dir)
    _write_atomic(os.path.join(ckpt_dir, POINTER), name + "\n")
    return final


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
    params, moments = _gather_stage(state)
    stage = state.coords["pp"]
    if params:
        _save_tensors(params, os.path.join(tmp, f"model-stage{stage:02d}.safetensors"))
    if moments:
        _save_tensors(moments, os.path.join(tmp, f"optim-stage{stage:02d}.safetensors"))
    dist.barrier()
    final = os.path.join(c.dir, name)
    if rank == 0:
        seal(tmp, _state_record(state))
        publish(c.dir, tmp, name)
        prune(c.dir, state.step, c.keep)
        size = sum(os.path.getsize(os.path.join(final, f)) for f in os.listdir(final))
        print(f"checkpoint: saved {final} ({size / 1e6:.2f} MB) in {time.perf_counter() - start:.2f} s", flush=True)
    dist.barrier()
    return final


# ---------------------------------------------------------------- loading


@torch.no_grad()
def copy_full(dst: torch.Tensor, full: torch.Tensor, name: str) -> None:
    """Copy this rank's slice of the full tensor into `dst` (a DTensor or a plain tensor)."""
    if list(full.shape) != list(dst.shape):
        raise RecipeError(f"{name}: the file holds shape {list(full.shape)}, the model needs {list(dst.shape)}")
    full = full.to(device=dst.device, dtype=dst.dtype)
    if isinstance(dst, DTensor):
        full = distribute_tensor(full, dst.device_mesh, dst.placements, src_data_rank=None)
        dst.to_local().copy_(full.to_local())
    else:
        dst.copy_(full)


def load_params(model: torch.nn.Module, files: TensorFiles) -> None:
    for name, p in model.named_parameters():
        copy_full(p, files.get(name), name)


def load_optimizer(optimizer, model: torch.nn.Module, files: TensorFiles) -> None:
    """Rebuild the optimizer state of this rank's parameters from full tensors."""
    keys: dict[str, list[str]] = {}
    for entry in files.index:
        param, _, key = entry.rpartition(".")
        keys.setdefault(param, []).append(key)
    for name, p in model.named_parameters():
        entry = {}
        for key in sorted(keys.get(name, [])):
            full = files.get(f"{name}.{key}")
            if full.ndim == 0:  # AdamW's step counter, kept on the CPU as AdamW keeps it
                entry[key] = full.clone()
            else:
                entry[key] = torch.zeros_like(p)
                copy_full(entry[key], full, f"{name}.{key}")
        if entry:
            optimizer.state[p] = entry


def _verify_hashes(step_dir: str, files: dict) -> None:
    """sha256 of every manifest file, split over the ranks; every rank raises the same error."""
    names, rank, world = sorted(files), dist.get_rank(), dist.get_world_size()
    bad = torch.zeros(len(names), dtype=torch.int32)
    for i in range(rank, len(names), world):
        bad[i] = sha256_file(os.path.join(step_dir, names[i])) != files[names[i]]["sha256"]
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bad.any():
        raise RecipeError(_corrupt(os.path.join(step_dir, names[int(bad.nonzero()[0])])))


def _resume(state, step_dir: str) -> None:
    record = check_checkpoint(step_dir, state.recipe.model, hashes=False)
    _verify_hashes(step_dir, read_manifest(step_dir)["files"])
    index = record["tensors"]
    with TensorFiles(step_dir, index["model"]) as files:
        load_params(state.model, files)
    with TensorFiles(step_dir, index.get("optim") or {}) as files:
        load_optimizer(state.optimizer, state.model, files)
    state.step = int(record["step"])
    rng = record.get("rng") or {}
    if "cpu" in rng:
        torch.set_rng_state(torch.tensor(rng["cpu"], dtype=torch.uint8))
    if "cuda" in rng and state.device.type == "cuda":
        torch.cuda.set_rng_state(torch.tensor(rng["cuda"], dtype=torch.uint8), state.device)


def load_at_start(state) -> None:
    """In setup: resume from checkpoint.resume, or else start from checkpoint.init_from_hf."""
    recipe, start = state.recipe, time.perf_counter()
    try:
        step_dir = resume_dir(recipe)
        if step_dir:
            _resume(state, step_dir)
            what = f"resumed from {step_dir} at step {state.step}"
        elif recipe.checkpoint.init_from_hf:
            hf_dir = recipe.checkpoint.init_from_hf
            with HFTensorFiles(hf_dir, check_hf_init(recipe)) as files:
                load_params(state.model, files)
            what = f"initialised from Hugging Face weights {hf_dir}"
        else:
            return
    except RecipeError:
        dist.destroy_process_group()
        raise
    if dist.get_rank() == 0:
        print(f"checkpoint: {what} in {time.perf_counter() - start:.2f} s", flush=True)


# ---------------------------------------------------------------- Hugging Face


def config_from_hf(hf: dict, where: str) -> ModelConfig:
    """A Hugging Face Llama config.json as a ModelConfig; what this Llama cannot run is refused."""

    def refuse(key: str, why: str) -> RecipeError:
        return RecipeError(f"{where}: {key}={hf.get(key)!r}: {why}")

    kind = hf.get("model_type", "llama")
    if kind not in ("llama", "mixtral"):
        raise refuse("model_type", "only Llama and Mixtral (model_type 'llama', 'mixtral') are supported")
    if kind == "mixtral" and hf.get("sliding_window") is not None:
        raise refuse("sliding_window", "sliding-window attention is not supported; use null")
    if kind == "mixtral" and hf.get("router_jitter_noise", 0.0):
        raise refuse("router_jitter_noise", "router noise is not supported; use 0.0")
    if hf.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", "only 'silu' (SwiGLU) is supported")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise refuse(key, "biases are not supported")
    rope = hf.get("rope_parameters") or {}
    if hf.get("rope_scaling") or rope.get("rope_type", rope.get("type", "default")) != "default":
        key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
        raise refuse(key, "only the default RoPE is supported (no scaling)")
    if hf.get("attention_dropout", 0.0):
        raise refuse("attention_dropout", "dropout is not supported; use 0.0")
    values = {key: hf.get(key, default) for key, default in HF_DEFAULTS.items()}
    if kind == "mixtral":
        values.update({key: hf.get(key, default) for key, default in MIXTRAL_DEFAULTS.items()})
    values["num_key_value_heads"] = hf.get("num_key_value_heads") or values["num_attention_heads"]
    values["rope_theta"] = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    try:
        cfg = recipe_from_dict({"model": values}).model
    except RecipeError as e:
        raise RecipeError(f"{where}: {e}") from None
    if cfg.hidden_size % cfg.num_attention_heads or (hf.get("head_dim") or cfg.head_dim) != cfg.head_dim:
        raise refuse(
            "head_dim",
            f"only head_dim = hidden_size / num_attention_heads is supported "
            f"({cfg.hidden_size} / {cfg.num_attention_heads})",
        )
    return cfg


def hf_config(cfg) -> dict:
    """config.json for transformers' LlamaForCausalLM, or MixtralForCausalLM for experts."""
    fields = {key: getattr(cfg, key) for key in LLAMA_KEYS}
    if cfg.num_local_experts:
        if cfg.shared_expert_intermediate_size or cfg.moe_layers is not None:
            raise RecipeError(
                f"model.shared_expert_intermediate_size={cfg.shared_expert_intermediate_size}, "
                f"moe_layers={cfg.moe_layers}: Mixtral has experts in every layer and no shared "
                f"expert; only such a model exports to Hugging Face"
            )
        fields.update({key: getattr(cfg, key) for key in MIXTRAL_DEFAULTS})
        return {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            **fields,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "sliding_window": None,
            "router_jitter_noise": 0.0,
            "output_router_logits": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "initializer_range": 0.02,
            "use_cache": True,
            "torch_dtype": "float32",
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **fields,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": "float32",
    }


def hf_index(hf_dir: str, cfg) -> dict[str, str]:
    """Tensor name -> safetensors file of a Hugging Face directory, checked against `cfg`."""
    if os.path.isfile(os.path.join(hf_dir, HF_INDEX)):
        weight_map = read_json(os.path.join(hf_dir, HF_INDEX), "index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(f, str) and os.path.basename(f) == f and f.endswith(".safetensors") for f in weight_map.values()
        ):
            raise RecipeError(
                f"{os.path.join(hf_dir, HF_INDEX)}: weight_map must map names to safetensors "
                f"files in the same directory"
            )
    elif os.path.isfile(os.path.join(hf_dir, HF_SINGLE)):
        weight_map = {name: HF_SINGLE for name in read_header(os.path.join(hf_dir, HF_SINGLE))}
    else:
        pickles = sorted(f for f in os.listdir(hf_dir) if f.endswith(PICKLE_SUFFIXES))
        also = f"; {', '.join(pickles)} (pickle) is never loaded: convert it to safetensors" if pickles else ""
        raise RecipeError(f"{hf_dir}: no {HF_SINGLE} or {HF_INDEX}{also}")
    for file in sorted(set(weight_map.values())):
        if not os.path.isfile(os.path.join(hf_dir, file)):
            raise RecipeError(f"{os.path.join(hf_dir, file)} is missing (a shard listed in {HF_INDEX})")
    weight_map = {
        n: f
        for n, f in weight_map.items()
        if not n.endswith("rotary_emb.inv_freq") and not (cfg.tie_word_embeddings and n == "lm_head.weight")
    }
    check_tensors(hf_dir, weight_map, hf_shapes(cfg))
    return weight_map


def read_hf_config(hf_dir: str, what: str) -> ModelConfig:
    if not os.path.isdir(hf_dir):
        raise RecipeError(f"{what}={hf_dir!r}: no such directory; give a Hugging Face Llama directory")
    path = os.path.join(hf_dir, "config.json")
    return config_from_hf(read_json(path, "Hugging Face config"), path)


def check_hf_init(recipe) -> dict[str, str]:
    """checkpoint.init_from_hf against the recipe's model; returns the tensor index."""
    hf_dir = recipe.checkpoint.init_from_hf
    theirs = read_hf_config(hf_dir, "checkpoint.init_from_hf")
    for f in dataclasses.fields(ModelConfig):
        if getattr(theirs, f.name) != getattr(recipe.model, f.name):
            raise RecipeError(
                f"checkpoint.init_from_hf={hf_dir!r}: config.json has {f.name}="
                f"{getattr(theirs, f.name)!r} but the recipe has model.{f.name}="
                f"{getattr(recipe.model, f.name)!r}; set model.{f.name}: {getattr(theirs, f.name)!r}"
            )
    return hf_index(hf_dir, recipe.model)


def _new_dir(out: str) -> None:
    """Refuse to write into an existing, non-empty directory: nothing is overwritten."""
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise RecipeError(f"OUT={out!r} exists and is not empty; nothing was written; give a new directory")


def _model_source(path: str, what: str) -> tuple[ModelConfig, TensorFiles]:
    """(config, its tensors by our names) of a Hugging Face directory or a dtensor3d
    checkpoint (step directory, or checkpoint directory meaning its newest); fully checked."""
    if os.path.isfile(os.path.join(path, "config.json")):
        cfg = read_hf_config(path, what)
        return cfg, HFTensorFiles(path, hf_index(path, cfg))
    step_dir = resolve(path, what)
    record = check_checkpoint(step_dir, None, hashes=True)
    return _model_config(record, os.path.join(step_dir, STATE)), TensorFiles(step_dir, record["tensors"]["model"])


def export_hf(ckpt: str, out: str, max_shard_bytes: int = 5_000_000_000) -> list[str]:
    """Write config.json and model.safetensors (or shards + index) for transformers."""
    cfg, source = _model_source(ckpt, "CKPT")
    step_dir, index = source.root, source.index
    config = hf_config(cfg)
    _new_dir(out)
    tmp = f"{out.rstrip(os.sep)}.tmp-export"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    shards = _shard_names(step_dir, index, max_shard_bytes)
    files = (
        [HF_SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    with source:
        for file, names in zip(files, shards):
            tensors = {k: v for n in names for k, v in to_hf(n, source.get(n)).items()}
            _save_tensors(tensors, os.path.join(tmp, file))
            weight_map.update(dict.fromkeys(tensors, file))
    if len(files) > 1:
        total = sum(os.path.getsize(os.path.join(tmp, f)) for f in files)
        _write_atomic(
            os.path.join(tmp, HF_INDEX),
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1),
        )
    _write_atomic(os.path.join(tmp, "config.json"), json.dumps(config, indent=1))
    if os.path.isdir(out):
        os.rmdir(out)
    os.rename(tmp, out)
    return files


def _shard_names(root: str, index: dict[str, str], max_bytes: int) -> list[list[str]]:
    """Tensor names in groups of at most max_bytes (one tensor per group at least)."""
    headers = {f: read_header(os.path.join(root, f)) for f in set(index.values())}
    shards: list[list[str]] = [[]]
    size = 0
    for name in index:
        offsets = headers[index[name]][name]["data_offsets"]
        n = offsets[1] - offsets[0]
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def import_hf(hf_dir: str, out: str) -> str:
    """A Hugging Face Llama directory as a dtensor3d checkpoint directory (step 0, no
    optimizer state); returns its step directory."""
    cfg = read_hf_config(hf_dir, "DIR")
    index = hf_index(hf_dir, cfg)
    _new_dir(out)
    os.makedirs(out, exist_ok=True)
    name = step_name(0)
    tmp = os.path.join(out, f".tmp-{name}")
    os.makedirs(tmp)
    with HFTensorFiles(hf_dir, index) as source:
        _save_tensors(
            {n: source.get(n).contiguous() for n in expected_shapes(cfg)},
            os.path.join(tmp, "model-stage00.safetensors"),
        )
    seal(tmp, {"step": 0, "source": os.path.abspath(hf_dir), "recipe": Recipe(model=cfg).to_dict()})
    return publish(out, tmp, name)


def load_model(path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """A single-device LlamaForCausalLM (forward(input_ids) -> logits [batch, seq, vocab])
    from a dtensor3d checkpoint (step or checkpoint directory) or a Hugging Face Llama
    directory, on the CPU, in eval mode."""
    cfg, files = _model_source(str(path), "load_model")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.to_empty(device="cpu")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    with files:
        load_params(model, files)
    return model.to(dtype).eval()
