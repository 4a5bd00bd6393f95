"""optimizer.state_dtype: 8bit for `plan`: which parameters keep torchao's 8-bit blocks
(training/optim_lowp.py's blocks_align, on the shapes plan knows) and the bytes they save
against fp32 moments. A quantised moment of n elements on a rank holds n uint8 codes, one
fp32 scale per block of 256 and torchao's 256-entry fp32 code map: n + 4 n / 256 + 1024 bytes
instead of 4 n (about 1.02 B an element). Pure Python."""

from __future__ import annotations

import math

from ..errors import RecipeError
from .params import FP32, param_table, shard_numel
from .shapes import param_shapes

BLOCK = 256  # torchao's AdamW8bit block
MIN_NUMEL = 4096  # torchao's smallest quantised tensor (of the whole parameter here)
QMAP_BYTES = 256 * FP32  # each quantised state's code map


def quantised(full: list[int], piece: list[int], group: int) -> bool:
    """Whether a parameter of shape `full`, tp / ep piece `piece` cut by FSDP over `group`
    ranks on dim 0 (even chunks of ceil(rows / group), the last short), has blocks that are
    runs of the full tensor on every rank: the piece's rows are whole rows of the full tensor
    or a multiple of 256 wide, and every FSDP chunk starts and ends on a block."""
    if math.prod(full) < MIN_NUMEL or not piece:
        return False
    inner = math.prod(piece[1:])
    if piece[1:] != full[1:] and piece[-1] % BLOCK:
        return False  # tp cuts a later dim (row-parallel): runs as wide as the piece's rows
    chunk = -(-piece[0] // group) * inner
    return chunk % BLOCK == 0 and (piece[0] * inner) % BLOCK == 0


def moment_bytes(numel: int, state_dtype: str, blocks: bool) -> int:
    """Bytes of one optimizer moment (AdamW's m or v, Muon's buffer) of `numel` elements on a
    rank: fp32 4 B an element, bf16 2 B; 8bit where the parameter keeps torchao's blocks
    (`quantised`) its codes, block scales and code map, else fp32."""
    if state_dtype == "8bit" and blocks:
        return numel + FP32 * numel // BLOCK + QMAP_BYTES
    return numel * (2 if state_dtype == "bfloat16" else FP32)


def param_state_bytes(recipe, full: list[int], piece: list[int], group: int, numel: int, muon: bool) -> int:
    """One parameter's optimizer state on a rank that holds `numel` of its elements (`full`:
    its shape, `piece`: its tp / ep piece, `group`: the FSDP ranks cutting that piece):
    AdamW's two moments and fp32 step, or a Muon matrix's one buffer (`muon`). What
    `plan --simulate` sums over a rank's real parameters; the estimate's optimizer bytes
    (muon_cost.optimizer_bytes) are the same sum over plan's shape table."""
    state = recipe.optimizer.state_dtype
    one = moment_bytes(numel, state, quantised(full, piece, group))
    return one if muon else 2 * one + FP32


def int8_savings(recipe, stage: int, one_moment) -> int:
    """Bytes the 8-bit blocks save on pp rank `stage` against fp32 moments; `one_moment(name,
    shape)`: a parameter with Muon's one buffer instead of AdamW's two moments."""
    p, full = recipe.parallelism, param_shapes(recipe.model)
    saved = 0
    for name, row in param_table(recipe).items():
        if row["stage"] != stage or not row["grad"]:
            continue
        shape = list(full.get(name, full["model.embed_tokens.weight"]))  # a tied / MTP copy: the embedding's
        group = row["group"] if p.fsdp_enabled else 1
        if not quantised(shape, row["shape"], group):
            continue
        n = shard_numel(row["shape"], group)
        moments = 1 if one_moment(name, shape) else 2
        saved += moments * (FP32 * n - moment_bytes(n, "8bit", True))
    return saved


def misaligned(recipe) -> str | None:
    """The first parameter one process keeps in 8-bit blocks whose blocks this mesh would cut
    differently (so it would keep fp32 moments here, and the run would leave one process's),
    said as the door says it; None when there is none."""
    p, full = recipe.parallelism, param_shapes(recipe.model)
    for name, row in param_table(recipe).items():
        shape = list(full.get(name, full["model.embed_tokens.weight"]))
        group = row["group"] if p.fsdp_enabled else 1
        if not row["grad"] or not quantised(shape, shape, 1) or quantised(shape, row["shape"], group):
            continue
        piece = row["shape"]
        if piece[1:] != shape[1:] and piece[-1] % BLOCK:
            return f"parallelism.tp={p.tp}: {name}'s row-parallel shards are {piece[-1]} wide"
        rows = -(-piece[0] // group)
        return f"FSDP over {group} ranks: {name}'s chunks of {rows} x {math.prod(piece[1:])} elements"
    return None


def check_blocks(recipe) -> None:
    """The door's check of optimizer.state_dtype: 8bit on this mesh (misaligned): one RecipeError."""
    where = misaligned(recipe) if recipe.optimizer.state_dtype == "8bit" else None
    if where:
        raise RecipeError(
            f"optimizer.state_dtype=8bit with {where}, not whole 256-element blocks of the full tensor: "
            "torchao's 8-bit states there would be cut into other blocks than one process's; valid: a mesh "
            "whose shards are whole blocks, or state_dtype: bfloat16"
        )
