"""User-facing errors: one base class, one subclass per source.

A `UserError` is a mistake the user can fix (a recipe key, a file, a directory, an
environment variable). The command line prints `error: <str(err)>` once per job and exits
with status 2; no traceback. This module must not import torch (`launch.sh` validates
before torchrun starts).
"""

from __future__ import annotations


class UserError(ValueError):
    """A wrong input; `str(err)` is the one line the user sees."""


class RecipeError(UserError):
    """A wrong recipe key, override or command-line argument."""


class CheckpointError(UserError):
    """A missing, incomplete, corrupt or mismatched checkpoint or Hugging Face directory."""


class DataError(UserError):
    """A missing or malformed data set, token file or tokenizer."""


class EnvError(UserError):
    """A wrong environment: variables, devices, unwritable directories."""


SUPERVISED = "DTENSOR3D_SUPERVISED"  # set for the workers by launch/supervise.py
RESIZE_CAUSE = "DTENSOR3D_RESIZE_CAUSE"  # set by the agent before an elastic restart: "node 1 lost"
# a worker's line for a collective that timed out (training/faults.py), which the agent reads
COLLECTIVE_TIMEOUT = "a collective did not complete within"


def is_rank0() -> bool:
    """This process is rank 0 of its job (RANK unset or unreadable counts as rank 0)."""
    import os

    rank = os.environ.get("RANK", "0").strip()
    return not rank.isdigit() or int(rank) == 0


def write_error_file(line: str, **extra) -> bool:
    """Under launch.sh (supervise), this rank's one line into torch's error file for its rank,
    where the supervisor reads it (`extra`: "short", "printed"); False elsewhere."""
    import json
    import os
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if os.environ.get(SUPERVISED) != "1" or not path:
        return False
    note = {"line": line, "time": time.time(), **extra}
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"message": line, "timestamp": int(time.time()), "dtensor3d": note}, f)
    except OSError:
        return False
    return True


def say(err: UserError) -> None:
    """The job's one `error:` line for `err`. Rank 0 prints it. Another rank under launch.sh
    (supervise.py) records it in torch's error file for the supervisor, which prints it when
    rank 0 did not fail the same way (an error only that rank saw); elsewhere it stays quiet
    (rank 0 says the same). Rank 0 records that it printed: the agent may stop it (SIGTERM)
    before it exits 2, when another rank's exit 2 came first, and the line must not be
    printed twice."""
    import sys

    line, printed = f"error: {err}", is_rank0()
    if printed:
        print(line, file=sys.stderr, flush=True)
    write_error_file(line, printed=printed)
