"""The bytes on disk: safetensors headers, the manifest with sha256, atomic writes, and
reading tensors by name. Nothing here knows about models, meshes or Hugging Face.

A step directory holds safetensors and JSON files only; `manifest.json` (written last)
lists every other file with its size and sha256. Only files the manifest names are opened,
only as safetensors or JSON: nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import struct
import sys

from ..errors import CheckpointError

FORMAT, VERSION = "dtensor3d-checkpoint", 2
READS = (1, 2)  # format versions this code loads (1: whole tensors per stage; 2: slices)
SLICES = "dtensor3d.slices"  # safetensors metadata key: JSON {key: {"name", "offset", "shape"}}
DTYPE_NAMES = {  # str(torch dtype): this module imports torch only to write (the door reads without it)
    "torch.float64": "F64",
    "torch.float32": "F32",
    "torch.float16": "F16",
    "torch.bfloat16": "BF16",
    "torch.int64": "I64",
    "torch.int32": "I32",
    "torch.int16": "I16",
    "torch.int8": "I8",
    "torch.uint8": "U8",
    "torch.bool": "BOOL",
}
MANIFEST, STATE, POINTER = "manifest.json", "state.json", "latest"
STEP_RE = re.compile(r"^step_(\d{8})$")


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
        raise CheckpointError(f"{what} {path} is missing") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{what} {path} is not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{what} {path} must hold a JSON object")
    return data


def fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: str, text: str) -> None:
    """Write a small text file by tmp + fsync + rename: readers see the old or the new one."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_tensors(tensors: dict, path: str, metadata: dict[str, str] | None = None) -> None:
    """A safetensors file written one tensor at a time, fsynced, with the mode of any other
    new file. A value is a tensor, or a (dtype, shape, produce) triple whose produce() gives
    the tensor when its turn comes (export: one full tensor in memory at a time). Unlike
    safetensors' save_file, no second copy of the whole set is ever held."""
    import torch

    specs = {
        k: (v.dtype, list(v.shape), lambda v=v: v) if isinstance(v, torch.Tensor) else v for k, v in tensors.items()
    }
    header, offset = {}, 0
    for key in sorted(specs):
        dtype, shape, _ = specs[key]
        n = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": DTYPE_NAMES[str(dtype)], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt", **(metadata or {})}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for key in sorted(specs):
            dtype, shape, produce = specs[key]
            t = produce().detach().to("cpu").contiguous()
            if t.dtype != dtype or list(t.shape) != list(shape):
                raise ValueError(f"{key}: produced {t.dtype} {list(t.shape)}, announced {dtype} {list(shape)}")
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(path, 0o666 & ~_umask())


def read_slices_meta(path: str) -> dict[str, dict]:
    """The slice places a dtensor3d writer put in a safetensors file's metadata ({} if none)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        meta = json.loads(f.read(n)).get("__metadata__") or {}
    return json.loads(meta[SLICES]) if SLICES in meta else {}


def read_header(path: str) -> dict[str, dict]:
    """A safetensors file's table {name: {dtype, shape, data_offsets}}, read without any
    tensor. A missing file, a bad header or a file shorter than its header: CheckpointError."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 <= n <= size - 8:
                raise CheckpointError(f"{path} is truncated or not a safetensors file ({size} bytes)")
            table = json.loads(f.read(n))
        table.pop("__metadata__", None)
        end = max((int(t["data_offsets"][1]) for t in table.values()), default=0)
        shapes = {k: list(t["shape"]) for k, t in table.items()}
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{path} is not a safetensors file (unreadable header)") from None
    if 8 + n + end > size:
        raise CheckpointError(f"{path} is truncated: its header describes {8 + n + end} bytes, the file has {size}")
    return {k: dict(table[k], shape=shapes[k]) for k in table}


def check_tensors(root: str, index: dict[str, str], expected: dict[str, list[int]], whose: str = "the model") -> None:
    """Every expected tensor is in its file with its shape, and there is nothing else."""
    headers: dict[str, dict] = {}
    for name, shape in expected.items():
        if name not in index:
            raise CheckpointError(f"{root}: no tensor {name}; {whose} needs it with shape {shape}")
        path = os.path.join(root, index[name])
        if path not in headers:
            headers[path] = read_header(path)
        entry = headers[path].get(name)
        if entry is None:
            raise CheckpointError(f"{path}: no tensor {name} (its index says it is there)")
        if entry["shape"] != shape:
            raise CheckpointError(f"{path}: {name} has shape {entry['shape']}, {whose} needs {shape}")
    extra = sorted(set(index) - set(expected))
    if extra:
        raise CheckpointError(
            f"{os.path.join(root, index[extra[0]])}: tensor {extra[0]} is not a parameter "
            f"of {whose} ({len(extra)} such tensors)"
        )


# ---------------------------------------------------------------- the manifest


def manifest_problem(step_dir: str) -> str | None:
    """Why a step directory is not complete (None: it is): no manifest (an interrupted save),
    or one that is not a dtensor3d manifest listing state.json."""
    path = os.path.join(step_dir, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return f"no {MANIFEST}"
    except (OSError, ValueError) as e:
        return f"{MANIFEST} is not readable JSON ({type(e).__name__})"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return f"{MANIFEST} is not a {FORMAT} manifest"
    files = manifest.get("files")
    if not isinstance(files, dict) or STATE not in files:
        return f"{MANIFEST} does not list {STATE}"
    return None


def read_manifest(step_dir: str) -> dict | None:
    """The manifest of a complete step directory; None when it has none (an interrupted save)."""
    if manifest_problem(step_dir) is not None:
        return None
    with open(os.path.join(step_dir, MANIFEST), encoding="utf-8") as f:
        return json.load(f)


def corrupt(path: str) -> str:
    return f"checkpoint file {path}: sha256 differs from {MANIFEST}'s (the file is corrupt or was changed)"


class DamagedCheckpoint(CheckpointError):
    """A complete step directory whose files are missing, truncated or corrupt (its sha256)."""


def check_files(step_dir: str, files: dict, hashes: bool) -> None:
    """Each manifest file is there with its size (and, if `hashes`, its sha256)."""
    for name in sorted(files):
        if os.path.basename(name) != name or not name.endswith((".safetensors", ".json")):
            raise CheckpointError(
                f"{os.path.join(step_dir, MANIFEST)} lists {name!r}; only safetensors and "
                f"JSON files in the step directory are loaded"
            )
    for name, info in sorted(files.items()):
        path = os.path.join(step_dir, name)
        if not os.path.isfile(path):
            raise DamagedCheckpoint(f"checkpoint file {path} is missing (listed in {MANIFEST})")
        size = os.path.getsize(path)
        if size != info.get("bytes"):
            raise DamagedCheckpoint(
                f"checkpoint file {path} has {size} bytes, {MANIFEST} says {info.get('bytes')} (truncated or changed)"
            )
        if hashes and sha256_file(path) != info.get("sha256"):
            raise DamagedCheckpoint(corrupt(path))


def slice_index(step_tmp: str, file: str) -> dict[str, dict]:
    """name -> {"shape", "slices"} of one file: the places its writer recorded, or (a file of
    whole tensors, e.g. import-hf's) each tensor whole at offset 0."""
    table, places = read_header(os.path.join(step_tmp, file)), read_slices_meta(os.path.join(step_tmp, file))
    out: dict[str, dict] = {}
    for key in sorted(table):
        shape = list(table[key]["shape"])
        place = places.get(key, {"name": key, "offset": [0] * len(shape), "shape": shape})
        entry = out.setdefault(place["name"], {"shape": list(place["shape"]), "slices": []})
        entry["slices"].append({"file": file, "key": key, "offset": list(place["offset"]), "shape": shape})
    return out


def seal(step_tmp: str, record: dict) -> None:
    """Finish a step directory: state.json (with the slice index of every tensor), then the manifest."""
    index: dict[str, dict] = {"model": {}, "optim": {}}
    for file in sorted(os.listdir(step_tmp)):
        if file.endswith(".safetensors"):
            kind = index["optim" if file.startswith("optim-") else "model"]
            for name, entry in slice_index(step_tmp, file).items():
                kind.setdefault(name, {"shape": entry["shape"], "slices": []})["slices"].extend(entry["slices"])
    for kind in index.values():
        for entry in kind.values():
            entry["slices"].sort(key=lambda s: s["offset"])
    record = {"format": FORMAT, "version": VERSION, **record, "tensors": index}
    write_atomic(os.path.join(step_tmp, STATE), json.dumps(record, indent=1))
    files = {
        f: {"bytes": os.path.getsize(os.path.join(step_tmp, f)), "sha256": sha256_file(os.path.join(step_tmp, f))}
        for f in sorted(os.listdir(step_tmp))
    }
    write_atomic(
        os.path.join(step_tmp, MANIFEST), json.dumps({"format": FORMAT, "version": VERSION, "files": files}, indent=1)
    )
    fsync(step_tmp)


def _set_aside(step_dir: str) -> None:
    """A broken step directory about to be written again is renamed, never deleted."""
    aside, n = f"{step_dir}.broken", 1
    while os.path.exists(aside):
        aside, n = f"{step_dir}.broken{n}", n + 1
    os.rename(step_dir, aside)
    print(
        f"warning: checkpoint {step_dir} was broken ({manifest_problem(aside)}); kept as {aside}",
        file=sys.stderr,
        flush=True,
    )


def publish(ckpt_dir: str, step_tmp: str, name: str) -> str:
    """Rename a sealed step directory into place (replacing one of the same step), then
    point `latest` at it."""
    final = os.path.join(ckpt_dir, name)
    if os.path.exists(final) and manifest_problem(final) is not None:
        _set_aside(final)
    if os.path.exists(final):
        old = os.path.join(ckpt_dir, f".old-{name}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(step_tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(step_tmp, final)
    fsync(ckpt_dir)
    write_atomic(os.path.join(ckpt_dir, POINTER), name + "\n")
    return final
