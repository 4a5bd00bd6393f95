"""One run at a time per checkpoint directory and per run directory: `checkpoint.dir/LOCK`
and `logging.run_dir/LOCK` hold the host and pid of the run writing there. A second run is
refused with one line naming the holder; a lock left by a process that is no longer running
on this host is taken over with a warning line. Only the job's rank 0 holds them, from before
the process group starts until it exits. A run directory reused after its run ended is not
refused (metrics.py keeps the earlier run's files aside).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time

from ..errors import CheckpointError

LOCK = "LOCK"
JOB = "DTENSOR3D_JOB"  # launch.sh, multi-node: the job's rendezvous id and endpoint; its nodes share the lock


def _alive(pid: int) -> bool:
    """Whether process `pid` of this host is running (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError, IndexError):
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    return True


def read_lock(path: str) -> dict | None:
    """The holder recorded in a lock file ({} when unreadable), or None when there is none."""
    try:
        with open(path, encoding="utf-8") as f:
            holder = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def is_stale(holder: dict) -> bool:
    """A lock of this host whose process is gone (or ours, left by an earlier life of this pid)."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    return holder["pid"] == os.getpid() or not _alive(holder["pid"])


CKPT_KEY, RUN_KEY = "checkpoint.dir", "logging.run_dir"
WHAT = {CKPT_KEY: "a checkpoint directory", RUN_KEY: "a run directory (metrics.jsonl, loss.svg)"}


def check_lock(ckpt_dir: str, key: str = CKPT_KEY) -> dict | None:
    """Refuse a directory (`key`: the recipe key naming it) another live run holds; returns a
    stale holder (or None)."""
    path = os.path.join(ckpt_dir, LOCK)
    holder = read_lock(path)
    if holder is None or is_stale(holder):
        return holder
    if held_by_this_job(holder):
        return None  # held by this job's rank 0 (another node, or a node coming back to it)
    who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} since {holder.get('since', '?')}"
    raise CheckpointError(
        f"{key}={ckpt_dir!r} is in use by another run ({who}; {path}); one run at a time writes "
        f"{WHAT[key]}: wait for it, use another {key}, or delete {path} if that run is gone"
    )


def held_by_this_job(holder: dict | None) -> bool:
    """The lock's holder is a running rank 0 of this multi-node job (launch.sh's DTENSOR3D_JOB)."""
    return bool(holder and holder.get("job") and holder.get("job") == os.environ.get(JOB))


def _create(path: str) -> bool:
    """Create the lock file with this process as holder; False when one exists."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if os.environ.get(JOB):
        holder["job"] = os.environ[JOB]
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(holder, f)
    return True


def acquire(ckpt_dir: str, key: str = CKPT_KEY) -> None:
    """Take the lock of `ckpt_dir` (created if missing), taking over a stale one with a warning."""
    path = os.path.join(ckpt_dir, LOCK)
    try:
        os.makedirs(ckpt_dir, exist_ok=True)
        for _ in range(3):
            if _create(path):
                return
            stale = check_lock(ckpt_dir, key)
            if stale is not None:
                aside = f"{path}.stale-{os.getpid()}"
                os.replace(path, aside)  # one taker wins the rename; a fresh lock is put back
                if read_lock(aside) != stale:
                    os.replace(aside, path)
                    continue
                os.remove(aside)
                print(
                    f"warning: {key}={ckpt_dir!r}: took over the lock of pid {stale.get('pid')} on "
                    f"{stale.get('host')}, which is no longer running",
                    file=sys.stderr,
                    flush=True,
                )
    except OSError as e:
        raise CheckpointError(f"{key}={ckpt_dir!r}: cannot create {path} ({e.strerror or e})") from None
    raise CheckpointError(f"{key}={ckpt_dir!r}: could not take {path}; another run is starting there")


def release(ckpt_dir: str) -> None:
    """Remove the lock if this process holds it."""
    path = os.path.join(ckpt_dir, LOCK)
    holder = read_lock(path)
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        with contextlib.suppress(OSError):
            os.remove(path)


def locked_dirs(recipe) -> list[tuple[str, str]]:
    """(directory, recipe key) of each lock a run holds: checkpoint.dir when it saves, and
    logging.run_dir unless it is the same directory."""
    ckpt_dir, run_dir = recipe.checkpoint.dir, recipe.logging.run_dir
    dirs = [(ckpt_dir, CKPT_KEY)] if ckpt_dir else []
    if run_dir and not (ckpt_dir and os.path.realpath(run_dir) == os.path.realpath(ckpt_dir)):
        dirs.append((run_dir, RUN_KEY))
    return dirs


def check_run_dir_lock(recipe) -> None:
    """The door's check of logging.run_dir's lock (checkpoint.dir's: dir_check.check_at_door)."""
    for folder, key in locked_dirs(recipe):
        if key == RUN_KEY:
            check_lock(folder, key)


@contextlib.contextmanager
def hold(recipe, rank: int):
    """Hold the locks of checkpoint.dir (when the recipe saves) and logging.run_dir for the
    body when this is the job's rank 0; otherwise do nothing."""
    dirs = locked_dirs(recipe) if rank == 0 else []
    taken = []
    try:
        for folder, key in dirs:
            acquire(folder, key)
            taken.append(folder)
        yield
    finally:
        for folder in reversed(taken):
            release(folder)
