"""The training loop's checkpoint writer (the only one): the step directories of `store`
(`stage_slices`, `write_slices`), with two additions.

- Agreement on failure: a writer whose files cannot be written (no space, a file-size
  limit, a vanished directory) tells every rank, and all raise one CheckpointError naming
  checkpoint.dir, the step and the step a resume would take instead. The half-written
  `.tmp-step_...` directory is removed; nothing published is touched.
- checkpoint.async (`async_save`): each rank's own slices (store.stage_slices: no
  collective, nothing gathered) are copied off the training tensors in the step, then
  written, sealed and published by a background thread while training goes on. At most
  one save is in flight: the next save, the end of training and a preemption wait for it.
  A process killed mid-write leaves only a `.tmp-step_...` directory without a manifest,
  which no resume takes.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
import time

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from .find import find_newest
from .format import publish, seal, step_name
from .save import copy_tokenizer, prune, stage_slices, state_record, write_slices


class Saver:
    """Writes checkpoints for one run. Every rank calls `save` and `wait` at the same steps."""

    def __init__(self, state):
        c = state.recipe.checkpoint
        self.dir, self.keep, self.background = c.dir, c.keep, c.async_save
        self.rank, self.device = dist.get_rank(), state.device
        self.thread: threading.Thread | None = None
        self.error: str | None = None  # this rank's failure in the save in flight
        self.writers_group = None
        self.pending_step: int | None = None
        if self.background and dist.get_world_size() > 1:  # the writers agree off the main thread
            every_rank = list(range(dist.get_world_size()))  # each rank writes the distinct slices it holds
            self.writers_group = dist.new_group(every_rank, backend="gloo")

    def save(self, state) -> str:
        """Checkpoint `state.step` (collective). Returns the step directory it will be."""
        self.wait()
        step = state.step
        tmp, final = os.path.join(self.dir, f".tmp-{step_name(step)}"), os.path.join(self.dir, step_name(step))
        self._agree(self._run(lambda: _fresh_dir(tmp, state.recipe) if self.rank == 0 else None), step)
        slices = stage_slices(state)
        record = state_record(state) if self.rank == 0 else None
        if not self.background:
            self._agree(self._run(lambda: write_slices(tmp, slices)), step)
            publish_ = (lambda: self._publish(tmp, final, step, record)) if self.rank == 0 else None
            self._agree(self._run(publish_), step)
            return final
        # Every rank may hold slices to write: the rest happens in the background on all.
        job = (
            tmp,
            final,
            step,
            dataclasses.replace(slices, params=_copied(slices.params), moments=_copied(slices.moments)),
            record,
        )
        self.pending_step = step
        self.thread = threading.Thread(target=self._write, args=job, name="dtensor3d-save", daemon=True)
        self.thread.start()
        return final

    def wait(self) -> None:
        """Collective: wait for the save in flight; every rank raises if any writer failed."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        self._agree(self.error, self.pending_step)

    def _write(self, tmp, final, step, slices, record) -> None:
        """The background part of an async save, on each rank."""
        error = self._run(lambda: write_slices(tmp, slices))
        if self.writers_group is not None:
            error = error or _peer_failed(error, self.writers_group)
        if self.rank == 0 and error is None:
            error = self._run(lambda: self._publish(tmp, final, step, record))
        self.error = error

    def _publish(self, tmp, final, step, record) -> None:
        start = time.perf_counter()
        seal(tmp, record)
        publish(self.dir, tmp, os.path.basename(final))
        prune(self.dir, step, self.keep)
        size = sum(os.path.getsize(os.path.join(final, f)) for f in os.listdir(final))
        how = " (written in the background)" if self.background else ""
        print(
            f"checkpoint: saved {final} ({size / 1e6:.2f} MB){how}, sealed in {time.perf_counter() - start:.2f} s",
            flush=True,
        )

    def _run(self, fn) -> str | None:
        """Run one part of a save (None: nothing to do); its failure as a short text."""
        try:
            if fn is not None:
                fn()
        except Exception as e:  # OSError, safetensors' own errors: all mean "not written"
            return " ".join(f"{type(e).__name__}: {e}".split())[:300]
        return None

    def _agree(self, error: str | None, step: int | None) -> None:
        """Collective: raise CheckpointError on every rank when any rank's part failed."""
        flag = torch.tensor([error is not None], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return
        self.error = None
        if self.rank == 0 and step is not None:
            shutil.rmtree(os.path.join(self.dir, f".tmp-{step_name(step)}"), ignore_errors=True)
        taken = find_newest(self.dir)[0] if os.path.isdir(self.dir) else None
        keep = f"{taken} is intact and is the step a resume takes" if taken else "no earlier checkpoint exists"
        why = f" ({error})" if error else " (on another rank)"
        raise CheckpointError(f"checkpoint.dir={self.dir!r}: saving step {step} failed{why}; {keep}")


def _fresh_dir(path: str, recipe) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    copy_tokenizer(recipe, path)  # the data's tokenizer.json, listed in the manifest


def _copied(tensors: dict) -> dict:
    """Own copies, so training may change the parameters while they are written."""
    return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}


def _peer_failed(error: str | None, group) -> str | None:
    """Among the stage writers (a background thread, its own group): whether any failed."""
    flag = torch.tensor([error is not None], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return "another stage's writer failed" if flag.item() else None
