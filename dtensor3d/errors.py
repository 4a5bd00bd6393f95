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
