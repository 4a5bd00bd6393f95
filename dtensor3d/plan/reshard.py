"""`parallelism.fsdp_reshard_after_forward: auto` (the default), decided from plan's memory
estimate: `never` (parameters gathered once per step: one all-gather per unit instead of two
per microbatch) with the largest `fsdp_bucket_layers` whose peak fits within
`training.memory_fraction` of the device's memory; where none fits, torchtitan's default
(resharded after each forward; a pipeline stage keeps its parameters gathered). The device's
memory: a GPU's own (the trainer asks torch; `plan --hardware` the table's `hbm_gb`); on CPU
this machine's available RAM divided by its ranks. Pure Python (no torch).
"""

from __future__ import annotations

import dataclasses
import os

from .params import rank_parts


def cpu_bytes(local_ranks: int) -> int | None:
    """This machine's available RAM (MemAvailable) divided by the ranks it runs."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // max(1, local_ranks)
    except OSError:
        return None
    return None


def local_ranks(recipe) -> int:
    """The ranks on this machine: torchrun's LOCAL_WORLD_SIZE, else the whole world."""
    text = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(text) if text.isdigit() else recipe.parallelism.world_size


def _with(recipe, policy: str, bucket: int | None = None):
    p = recipe.parallelism
    changes = {"fsdp_reshard_after_forward": policy} | ({"fsdp_bucket_layers": bucket} if bucket else {})
    return dataclasses.replace(recipe, parallelism=dataclasses.replace(p, **changes))


def _largest_bucket(recipe, budget: float, peak) -> tuple[int, int] | None:
    """(the largest fsdp_bucket_layers whose `never` peak is within budget, that peak), or None.
    The estimate's peak under `never` holds every unit gathered whatever their size, so the
    largest (a stage's layers in one unit) is tried first; else a search down to 1."""
    most = max(1, max(len(part.layers) for part in rank_parts(recipe)))
    top = peak(_with(recipe, "never", most))
    if top <= budget:
        return most, top
    if most == 1 or peak(_with(recipe, "never", 1)) > budget:
        return None
    lo, hi, best = 1, most - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        used = peak(_with(recipe, "never", mid))
        if used <= budget:
            best, lo = (mid, used), mid + 1
        else:
            hi = mid - 1
    return best


def resolve(recipe, device_bytes: int | None, peak):
    """(the recipe with `auto` decided, one line saying the choice; None where nothing was
    auto). `device_bytes` None: unknown (a GPU recipe planned without --hardware): the default.
    `peak(recipe)`: plan's peak bytes per rank (estimate.peak_bytes; estimate.py passes it)."""
    p = recipe.parallelism
    if p.fsdp_reshard_after_forward != "auto":
        return recipe, None
    if not p.fsdp_enabled:
        return _with(recipe, "default"), None
    if device_bytes is None:
        line = "fsdp_reshard_after_forward auto: default (the device's memory is not known here; decided at launch)"
        return _with(recipe, "default"), line
    budget = recipe.training.memory_fraction * device_bytes
    best = _largest_bucket(recipe, budget, peak)
    share = f"{recipe.training.memory_fraction:g} x {_size(device_bytes)}"
    if best is None:
        need = _size(peak(_with(recipe, "never", 1)))
        return _with(recipe, "default"), f"fsdp_reshard_after_forward auto: default (never needs {need} > {share})"
    line = (
        f"fsdp_reshard_after_forward auto: never with fsdp_bucket_layers {best[0]} "
        f"(plan's peak {_size(best[1])} per rank <= {share})"
    )
    return _with(recipe, "never", best[0]), line


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def hardware_bytes(hw, recipe, nodes: int) -> int:
    """A device's memory from the hardware table (a CPU entry's RAM is shared by its node's ranks)."""
    shared = recipe.parallelism.world_size // nodes if hw.cores_per_node else 1
    return int(hw.hbm_gb * 1e9 / shared)


def resolve_here(recipe, peak):
    """`resolve` with what this process can know without torch: on CPU this machine's memory
    per local rank; a GPU recipe's device is not known (the trainer resolves with its own)."""
    if recipe.training.device == "cuda" or recipe.parallelism.fsdp_reshard_after_forward != "auto":
        return resolve(recipe, None, peak)
    return resolve(recipe, cpu_bytes(local_ranks(recipe)), peak)
