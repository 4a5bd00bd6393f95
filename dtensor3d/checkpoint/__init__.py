"""Checkpoints: safetensors and JSON only, written atomically, resumable at any mesh, and
Hugging Face Llama / Mixtral import and export.

    format.py   the bytes: safetensors headers (written tensor by tensor), manifest + sha256, atomic writes
    slices.py   which piece of each tensor a rank holds and writes; reading any region of a tensor
    store.py    the checkpoint directory: find the newest, check a step against a recipe, the record
                and slices a save writes (background.py's Saver writes them), prune
    hf.py       Hugging Face config and names; export_hf, import_hf, load_model
    resume.py   how a run starts: check_at_door (before any process group), load_at_start
    lock.py     one run at a time per checkpoint directory

Layering (no import circle): format <- slices <- store <- hf <- resume; lock needs only format's errors.
"""

from .format import publish, read_header, seal, sha256_file, step_name
from .hf import config_from_hf, export_hf, hf_config, import_hf, load_model
from .lock import hold
from .resume import check_at_door, load_at_start
from .store import checkpoint_due, expected_shapes, newest, prune, resolve, resume_dir

__all__ = [
    "check_at_door",
    "checkpoint_due",
    "config_from_hf",
    "expected_shapes",
    "export_hf",
    "hf_config",
    "hold",
    "import_hf",
    "load_at_start",
    "load_model",
    "newest",
    "prune",
    "publish",
    "read_header",
    "resolve",
    "resume_dir",
    "seal",
    "sha256_file",
    "step_name",
]
