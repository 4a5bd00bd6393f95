"""checkpoint.dir at the door (launch.sh's `validate` and each rank's start, before any process
group): writable, not locked by another run, and the step a run would resume from checked
against the recipe, or its init_from_hf directory. No torch unless there is such a step or
directory to check (check.py and hf.py build the model on the meta device)."""

from __future__ import annotations

import os
import socket
import sys

from ..errors import CheckpointError, is_rank0
from .find import resume_target
from .format import STATE, DamagedCheckpoint
from .lock import LOCK, check_lock, held_by_this_job, read_lock


def check_dir_writable(ckpt_dir: str) -> None:
    """checkpoint.dir is a directory this process can write (created when missing)."""
    if os.path.exists(ckpt_dir) and not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"checkpoint.dir={ckpt_dir!r} is an existing file, not a directory; give a directory")
    probe = os.path.join(ckpt_dir, f".write-probe-{socket.gethostname()}-{os.getpid()}")
    try:
        os.makedirs(ckpt_dir, exist_ok=True)
        with open(probe, "w", encoding="utf-8") as f:
            f.write("probe\n")
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(
            f"checkpoint.dir={ckpt_dir!r} is not writable ({e.strerror or e}); checkpoints could not be "
            f"saved there; give a writable directory"
        ) from None


def check_at_door(recipe, hashes: bool, lock: bool = True) -> None:
    """The checks before any process group: checkpoint.dir writable (and, if `lock`, held by
    no other run); the checkpoint a run resumes from, against the recipe (model, trajectory,
    files; `hashes`: every file's sha256 too), or else its `init_from_hf` directory.
    Warnings about broken newer steps are printed once, by rank 0 (the RANK variable)."""
    c = recipe.checkpoint
    if c.dir:
        check_dir_writable(c.dir)
        if lock:
            check_lock(c.dir)
            if held_by_this_job(read_lock(os.path.join(c.dir, LOCK))):
                return  # a node joining a running job: the job writes there now; its ranks check what they load
    step_dir, warnings = resume_target(recipe)
    record = None
    if step_dir:
        from .check import check_checkpoint, check_trajectory
    while step_dir:
        try:
            record = check_checkpoint(step_dir, recipe.model, hashes)
            break
        except DamagedCheckpoint as e:
            if not (hashes and c.resume == "auto" and c.on_damaged == "previous"):  # launch.sh's door only
                raise
            aside = set_aside(step_dir)
            step_dir, more = resume_target(recipe)
            instead = f"resuming from {step_dir}" if step_dir else "no complete step is left: starting fresh"
            warnings += [f"warning: {e}; set it aside as {aside}; {instead}", *more]
    if is_rank0():
        for line in warnings:
            print(line, file=sys.stderr, flush=True)
    if record is not None:
        if "source" not in record:  # an import-hf checkpoint starts a run; it continues none
            check_trajectory(record, recipe, os.path.join(step_dir, STATE))
    elif c.init_from_hf:
        from .hf import check_hf_init

        check_hf_init(recipe)


def set_aside(step_dir: str) -> str:
    """Rename a damaged step directory out of the resume's way (kept: nothing on disk is lost)."""
    base = os.path.normpath(step_dir) + ".damaged"
    aside, n = base, 1
    while os.path.exists(aside):
        n += 1
        aside = f"{base}-{n}"
    try:
        os.rename(step_dir, aside)
    except FileNotFoundError:  # another node's door set it aside first
        pass
    return aside
