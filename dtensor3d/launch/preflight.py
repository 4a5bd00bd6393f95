"""Checks at the door that look at this machine, not at the recipe: the device the recipe
asks for and `logging.run_dir`. `validate` (launch.sh, before torchrun) and `train` (each
rank, before any process group) call `check_machine`. Nothing is created here; torch is
imported only to ask about CUDA, when the recipe says `training.device: cuda`.
"""

from __future__ import annotations

import os

from ..errors import EnvError


def check_machine(recipe, local_processes: int) -> None:
    """The device and the run directory, for `local_processes` processes on this node."""
    check_device(recipe.training.device, local_processes)
    check_run_dir(recipe.logging.run_dir)


def check_device(device: str, local_processes: int) -> None:
    """`cuda`: this node has a CUDA device for each of its processes. (`auto` takes what there is.)"""
    if device != "cuda":
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise EnvError(
            "training.device=cuda but this machine has no usable CUDA device (torch.cuda.is_available() "
            "is False); valid here: cpu or auto"
        )
    if local_processes > count:
        raise EnvError(
            f"training.device=cuda: {local_processes} processes on this node but {count} CUDA device(s); "
            f"valid: at most {count} per node (more nodes, or a smaller mesh) or training.device=cpu"
        )


def check_run_dir(path: str) -> None:
    """logging.run_dir is a directory this process can write, or one it can create."""
    key = f"logging.run_dir={path!r}"
    if os.path.exists(path) and not os.path.isdir(path):
        raise EnvError(f"{key} is an existing file, not a directory; give a directory path")
    existing = _nearest_existing(path)
    if not os.path.isdir(existing):
        raise EnvError(f"{key} cannot be created: {existing!r} is a file, not a directory; give a directory path")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == os.path.abspath(path) else f" (its parent {existing!r})"
        raise EnvError(f"{key}{where} is not writable ({_why(existing)}); give a writable directory")


def _nearest_existing(path: str) -> str:
    """`path` itself, or its nearest ancestor that exists."""
    current = os.path.abspath(path)
    while not os.path.exists(current):
        current = os.path.dirname(current)
    return current


def _why(path: str) -> str:
    try:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return "a read-only file system" if read_only else "permission denied"
