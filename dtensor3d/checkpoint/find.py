"""Finding checkpoints: the newest complete step directory of checkpoint.dir (the `latest`
pointer's, else the highest complete one; broken newer ones named in a warning), and what a
run resumes from. The directory's layout is in checkpoint/__init__.py."""

from __future__ import annotations

import contextlib
import os

from ..errors import CheckpointError
from .format import (
    MANIFEST,
    POINTER,
    STEP_RE,
    manifest_problem,
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
