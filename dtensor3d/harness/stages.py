"""The live model's forward under pipeline parallelism, for the harness: a batch of requests
runs through the pipeline stages in order, each stage on the pp rank that holds it (the
training schedule's stage modules, or the eval command's own under `--pp`; FSDP and tp as
they are: nothing gathered), the hidden
states going from rank to rank with point-to-point sends, and the last stage's logits
broadcast over the pp group (every pp rank runs the same requests: the harness's ranks are
the dp x cp ranks).

Every rank of a pp group calls `forward` with the same ids: the stages run in global order,
a rank sending its stage's output to the next stage's rank and receiving its own input from
the previous one's (a V schedule's rank holds two stages: both run, each at its turn). With a
KV cache (generation) every stage module shares one KVCache (its layers are keyed by module),
whose length each stage starts from and the caller advances.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..plan.schedule_model import stage_rank

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class StageChain:
    """This rank's pipeline stages, run in the pipeline's order: `state.stages` ([(global stage
    index, module)], as parallelize_stages returns them: the eval command's), else the training
    schedule's."""

    def __init__(self, state):
        p = state.recipe.parallelism
        if getattr(state, "stages", None):
            self.modules = dict(state.stages)
        else:  # torch's schedules hold their PipelineStages as _stages (multi-stage) or _stage
            held = getattr(state.schedule, "_stages", None) or [state.schedule._stage]
            self.modules = {stage.stage_index: stage.submod for stage in held}
        self.owner = [stage_rank(p, s) for s in range(p.pp_stages)]
        self.pp_rank, self.group = state.coords["pp"], state.mesh["pp"].get_group()
        self.device, self.vocab = state.device, state.recipe.model.padded_vocab_size

    def _peer(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.group, pp_rank)

    def _send(self, h: torch.Tensor, pp_rank: int) -> None:
        head = torch.tensor([*h.shape, DTYPES.index(h.dtype)], device=self.device)
        dist.send(head, self._peer(pp_rank), group=self.group)
        dist.send(h.contiguous(), self._peer(pp_rank), group=self.group)

    def _recv(self, pp_rank: int) -> torch.Tensor:
        head = torch.zeros(4, dtype=torch.long, device=self.device)
        dist.recv(head, self._peer(pp_rank), group=self.group)
        h = torch.empty(*head[:3].tolist(), dtype=DTYPES[int(head[3])], device=self.device)
        dist.recv(h, self._peer(pp_rank), group=self.group)
        return h

    def forward(self, ids: torch.Tensor, cache=None, at: int | None = None) -> torch.Tensor:
        """The logits [b, s, vocab] of ids [b, s] (position `at`'s [b, vocab] where given) on
        every pp rank, in float32; torch.no_grad and the compute context are the caller's."""
        from torch.distributed.tensor import DTensor

        length = cache.length if cache is not None else 0
        h, out = ids, None
        for s, owner in enumerate(self.owner):
            if owner != self.pp_rank:
                continue
            if s > 0 and self.owner[s - 1] != self.pp_rank:
                h = self._recv(self.owner[s - 1])
            if cache is not None:
                cache.length = length  # each stage's attention reads its positions from here
            h = self.modules[s](h) if cache is None else self.modules[s](h, cache)
            if s + 1 < len(self.owner) and self.owner[s + 1] != self.pp_rank:
                self._send(h, self.owner[s + 1])
            if s + 1 == len(self.owner):
                out = h.full_tensor() if isinstance(h, DTensor) else h  # tp: sharded on the vocabulary
                out = (out if at is None else out[:, at]).float().contiguous()
        if cache is not None:
            cache.length = length + ids.shape[1]
        if out is None:
            shape = (*ids.shape, self.vocab) if at is None else (ids.shape[0], self.vocab)
            out = torch.empty(shape, dtype=torch.float32, device=self.device)
        dist.broadcast(out, self._peer(self.owner[-1]), group=self.group)
        return out
