"""export-hf's and import-hf's OUT: a new or empty directory, or, with --overwrite, a directory
the same command wrote (its MARK file names the command, as prepare-data's meta.json marks
its own directories). Anything else is refused with one line naming what OUT holds; a
replaced directory is swapped out only once the new one is complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from .format import CheckpointError

MARK = ".dtensor3d-written-by"  # {"command": "export-hf" | "import-hf"}


def written_by(out: str) -> str | None:
    """The command that wrote directory `out` (its MARK), or None."""
    try:
        with open(os.path.join(out, MARK), encoding="utf-8") as f:
            command = json.load(f).get("command")
    except (OSError, ValueError, AttributeError):
        return None
    return command if isinstance(command, str) else None


def _holds(names: list[str]) -> str:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"it holds {shown}"


def check_out(out: str, command: str, overwrite: bool) -> bool:
    """Refuse an OUT that is a file, a non-empty directory (without --overwrite), or one this
    command did not write (with it), or where this process cannot write. True: OUT is a
    directory of ours that --overwrite replaces."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise CheckpointError(f"OUT={out!r} exists and is a file; nothing was written; give a new directory")
    names = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if names and not overwrite:
        raise CheckpointError(
            f"OUT={out!r} exists and is not empty ({_holds(names)}); nothing was written; give a new directory, "
            f"or pass --overwrite to replace a directory {command} wrote"
        )
    if names and written_by(out) != command:
        raise CheckpointError(
            f"OUT={out!r} is not a directory {command} wrote (no {MARK} naming it; {_holds(names)}); nothing was "
            f"written; --overwrite replaces only those: give a new or empty directory"
        )
    _check_writable(out)
    return bool(names)


def _check_writable(out: str) -> None:
    """OUT, or the nearest directory above it that exists, takes a new file."""
    where = os.path.abspath(out)
    while not os.path.isdir(where):
        where = os.path.dirname(where)
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=where)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(
            f"OUT={out!r}: cannot write {where} ({e.strerror or e}); nothing was written; give a writable directory"
        ) from None


def mark(folder: str, command: str) -> None:
    """Name `command` as the writer of `folder` (what --overwrite looks for)."""
    with open(os.path.join(folder, MARK), "w", encoding="utf-8") as f:
        json.dump({"command": command}, f)
        f.write("\n")


def swap_in(new: str, out: str) -> None:
    """Put the complete directory `new` in place of `out` (an empty or replaced one)."""
    old = None
    if os.path.isdir(out) and os.listdir(out):
        old = f"{out.rstrip(os.sep)}.old-{os.getpid()}"
        os.rename(out, old)
    elif os.path.isdir(out):
        os.rmdir(out)
    os.rename(new, out)
    if old:
        shutil.rmtree(old, ignore_errors=True)
