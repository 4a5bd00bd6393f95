"""The recipe's `parallelism` section: the mesh, how each dimension runs, and the named facts
about it (`fsdp_enabled`, `batch_ranks`, `sequence_divisor`, ...) that every other file asks
instead of re-deriving conditions; and the pipeline's stage placement. Part of the schema
(config/schema.py re-exports it); no torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from .fields import knob


def stage_layers(num_layers: int, pp: int, pp_layers: tuple[int, ...] | None = None) -> list[range]:
    """The global decoder layer indices of each pipeline stage: `pp_layers` if given, else
    balanced by count with earlier stages taking the remainder."""
    counts = list(pp_layers) if pp_layers else [num_layers // pp + (i < num_layers % pp) for i in range(pp)]
    starts = [sum(counts[:i]) for i in range(pp)]
    return [range(s, s + c) for s, c in zip(starts, counts)]


def window_tails(window: int | None, seq_len: int, cp: int) -> int | None:
    """Context parallelism under a sliding window: how many keys of the chunk before it each
    zigzag chunk (seq_len / 2cp tokens) needs -- window - 1, where that fits in one chunk: a rank
    then gathers only those tails, not the whole sequence (parallel/context.py). None: no window,
    cp 1, or a window wider than a chunk (the whole sequence is gathered)."""
    if window is None or cp == 1 or window - 1 > seq_len // (2 * cp):
        return None
    return window - 1


V_SCHEDULES = ("zbv", "dualpipev")  # two stages per rank, placed in a V (rank r: stages r and 2*pp-1-r)


@dataclass(frozen=True)
class ParallelismConfig:
    """The mesh and how each dimension runs; nanotron's keys are accepted as they are."""

    dp: int = knob(1, "data-parallel size", positive=True)
    tp: int = knob(1, "tensor-parallel size", positive=True)
    pp: int = knob(1, "pipeline-parallel size (pipeline ranks)", positive=True)
    cp: int = knob(1, "context-parallel size", positive=True, aliases=("context_parallel_size",))
    ep: int = knob(1, "expert-parallel size", positive=True, aliases=("expert_parallel_size",))
    pp_engine: Literal["1f1b", "afab", "interleaved_1f1b", "zbv", "dualpipev"] = knob(
        "1f1b", "the pipeline schedule (afab: all forward, all backward; zbv: zero-bubble V)"
    )
    pp_layers: tuple[int, ...] | None = knob(None, "layers per pipeline stage, e.g. [3, 1]; null: an even split")
    tp_mode: Literal["ALL_REDUCE", "REDUCE_SCATTER"] = knob(
        "ALL_REDUCE", "REDUCE_SCATTER: sequence parallelism between the tp regions"
    )
    tp_linear_async_communication: bool = knob(False, "nanotron's key: overlap tp communication with compute")
    recompute_layer: bool = knob(False, "nanotron's key: recompute every decoder layer (recompute: full)")
    dp_mode: Literal["shard", "replicate", "hybrid"] = knob(
        "shard", "shard: FSDP2; replicate: DDP-style all-reduce; hybrid: HSDP (FSDP in groups of dp_shard)"
    )
    dp_shard: int = knob(0, "dp_mode hybrid: dp ranks per FSDP group (must divide dp); 0: unset")
    fsdp_reshard_after_forward: Literal["auto", "default", "always", "never"] = knob(
        "auto",
        "torchtitan's key: FSDP2 frees gathered parameters after each forward (always) or keeps them "
        "gathered for the whole step (never: one all-gather per step, the full parameters in memory); "
        "default: always, never for a pipeline stage; auto: never with the largest fsdp_bucket_layers that fits, "
        "where plan's peak memory for it is within training.memory_fraction of the device's (CPU: available RAM "
        "/ local ranks), else default (plan/reshard.py; the run's first lines say the choice)",
    )
    fsdp_bucket_layers: int = knob(
        1,
        "decoder layers per FSDP2 unit (one all-gather and one reduce-scatter each): more layers, fewer and "
        "larger collectives, more parameters gathered at once",
        positive=True,
    )
    pp_virtual_stages: int = knob(0, "stages per pipeline rank; 0: the schedule's own (2 for the multi-stage ones)")
    recompute: Literal["none", "full", "selective"] | None = knob(
        None, "activation recomputation; null: recompute_layer's (true: full, else none)"
    )

    def __post_init__(self):
        if self.recompute is None:  # nanotron's recompute_layer: true keeps meaning full
            object.__setattr__(self, "recompute", "full" if self.recompute_layer else "none")

    @property
    def dims(self) -> dict[str, int]:
        """Mesh axis sizes in nanotron's order: ep, pp, dp, cp, tp (tp fastest)."""
        return {"ep": self.ep, "pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}

    @property
    def world_size(self) -> int:
        return math.prod(self.dims.values())

    # Named facts about the mesh: every other file asks these instead of re-deriving them.
    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def dp_cp(self) -> int:
        """Ranks that hold the same parameters and different tokens (FSDP's dense group size / ep)."""
        return self.dp * self.cp

    @property
    def batch_ranks(self) -> int:
        """Ranks that split the global batch by samples: ep x dp."""
        return self.ep * self.dp

    def batch_rank(self, coords: dict[str, int]) -> int:
        """This rank's index among the `batch_ranks` (ep-major, as in the rank matrix)."""
        return coords["ep"] * self.dp + coords["dp"]

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 shards parameters over ep x dp x cp (dense) and dp x cp (experts); under
        dp_mode hybrid over ep x dp_shard x cp and dp_shard x cp, replicated over dp_replicate."""
        return self.dp_mode in ("shard", "hybrid") and self.ep * self.dp_cp > 1

    @property
    def hsdp_enabled(self) -> bool:
        """dp_mode hybrid: FSDP within groups of dp_shard dp ranks, replicated across them."""
        return self.dp_mode == "hybrid"

    @property
    def dp_replicate(self) -> int:
        """HSDP's replica count: dp / dp_shard (1 unless dp_mode is hybrid)."""
        return self.dp // self.dp_shard if self.hsdp_enabled and self.dp_shard else 1

    @property
    def replicate_enabled(self) -> bool:
        """Gradients are all-reduced over ep x dp x cp (dense) and dp x cp (experts)."""
        return self.dp_mode == "replicate" and self.ep * self.dp_cp > 1

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP2 frees a unit's gathered parameters after each forward (and gathers them again
        for the backward); else they stay gathered for the whole step (a pipeline stage by
        default, any run with `fsdp_reshard_after_forward: never`)."""
        if self.fsdp_reshard_after_forward in ("default", "auto"):  # auto: before plan/reshard.py decides it
            return not self.pp_enabled
        return self.fsdp_reshard_after_forward == "always"

    @property
    def sequence_parallel(self) -> bool:
        return self.tp_mode == "REDUCE_SCATTER"

    @property
    def loss_parallel(self) -> bool:
        """Logits stay sharded on the vocabulary over tp; the loss is computed on the shards."""
        return self.tp_enabled

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each pp rank holds: 2 for the V schedules (zbv, dualpipev), pp_virtual_stages
        (default 2) for interleaved_1f1b, 1 otherwise."""
        if self.pp_engine in V_SCHEDULES:
            return 2
        if self.pp_engine == "interleaved_1f1b":
            return self.pp_virtual_stages or 2
        return 1

    @property
    def pp_stages(self) -> int:
        """Pipeline stages in all: pp ranks x stages_per_rank."""
        return self.pp * self.stages_per_rank

    @property
    def sequence_divisor(self) -> int:
        """sequence_length must be a multiple of this: 2*cp zig-zag chunks, and tp*cp under
        sequence parallelism."""
        divisor = 2 * self.cp if self.cp_enabled else 1
        return math.lcm(divisor, self.tp * self.cp) if self.sequence_parallel else divisor
