"""Checkpoints: safetensors and JSON only, written atomically, resumable at any mesh, and
Hugging Face import and export for every model family.

    format.py      the bytes: safetensors headers (written tensor by tensor), manifest + sha256, atomic writes
    slices.py      which piece of each tensor a rank holds and writes; reading any region of a tensor
    find.py        the newest complete step of a checkpoint directory; what a run resumes from
    check.py       a step directory against a recipe (shapes, slices, optimizer, trajectory), no process group
    save.py        what a save writes: this rank's slices, the state record, the tokenizer; pruning
    optim_state.py optimizer states as held (optimizer.state_dtype): bf16, 8-bit codes with their block scales
    background.py  the Saver (the loop's only writer; sync or async)
    hf.py          Hugging Face config and names; export_hf, import_hf, load_model
    outdir.py      export-hf's and import-hf's OUT: new, empty, or (--overwrite) one the same command wrote
    dir_check.py   checkpoint.dir at the door, before any process group (check_at_door: torch only for a step)
    resume.py      how a run starts from disk: load_at_start
    lock.py        one run at a time per checkpoint directory and per logging.run_dir

    checkpoint.dir/
        step_00000010/
            model-stage00.safetensors   stage 0's first rank's slices of the parameters, by
                                        global name (Hugging Face LlamaForCausalLM's names)
            model-stage00-rank00001.safetensors   another rank's slices (one file per writer)
            optim-stage00[-rankNNNNN].safetensors AdamW state: "<param>.exp_avg", ".exp_avg_sq", ".step"
                                        (state_dtype 8bit: uint8 codes, and "<param>.exp_avg_scale" ...)
            state.json                  step, LR, data position, RNG, the recipe, the slice index
            manifest.json               size and sha256 of every other file; written last
        latest                          "step_00000010", replaced after the step directory exists
        LOCK                            host and pid of the run writing here (lock.py)

Saving gathers nothing: each rank writes the distinct slices it holds (slices.py: the rank at
coordinate 0 on every axis over which a tensor is replicated writes it), each slice's place
in the full tensor in its file's metadata and in state.json's index. A step directory is
written as `.tmp-step_...`, sealed with its manifest and renamed into place, so a reader
sees a whole step or none.

Layering (no import circle): format <- slices <- find, check, save <- hf <- background, dir_check, resume;
lock needs only format's errors, outdir only format's. May import config, models and parallel.shards.
"""

import importlib

# Each name's module, imported at its first use (PEP 562): launch.sh's door (lock.py, dir_check.py) then
# imports no torch unless there is a step to check (check.py, hf.py and resume.py import torch).
_WHERE = {
    "expected_shapes": "check",
    "newest": "find",
    "resolve": "find",
    "resume_dir": "find",
    "publish": "format",
    "read_header": "format",
    "seal": "format",
    "sha256_file": "format",
    "step_name": "format",
    "config_from_hf": "hf",
    "export_hf": "hf",
    "hf_config": "hf",
    "import_hf": "hf",
    "load_model": "hf",
    "hold": "lock",
    "check_at_door": "dir_check",
    "load_at_start": "resume",
    "checkpoint_due": "save",
    "prune": "save",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value
