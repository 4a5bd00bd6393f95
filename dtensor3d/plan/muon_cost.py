"""optimizer.name: muon's cost (training/muon.py, training/muon_owners.py) for `plan`: which parameters
are Muon's, the momentum buffer they keep instead of AdamW's two moments and step, and the
bytes of the owner-rank exchange. Pure Python.

Each matrix's holders (the ranks whose pieces meet it: FSDP's and tp's splits; an expert's
matrix sits whole on one rank, since FSDP and ep cut the experts' dim) send the owner their
pieces and get theirs back, in Newton-Schulz's dtype (optimizer.muon_ns_dtype: bf16 2 bytes, fp32 4):
per matrix and replica group 2 x width x (numel - the
owner's piece) sent, counted (as parallel/comm.py counts them) as point-to-point sends on the
default group: "world", "send_recv". Which rank owns which matrix goes round-robin, so a
rank's own share varies: the estimate is the stage's total over its ranks (even pieces), and
the owner's transient, the matrices it orthogonalises at once, as the mean per rank.
"""

from __future__ import annotations

from .params import FP32, param_table, shard_numel
from .shapes import param_shapes, tp_dim
from .state_bytes import int8_savings, moment_bytes

BF16 = 2


def is_muon(name: str, shape) -> bool:
    """training/muon.is_muon_matrix on names and shapes: a decoder layer's matrix (or stack
    of expert matrices), not the router's gate."""
    return name.startswith("model.layers.") and len(shape) >= 2 and not name.endswith((".gate.weight", "_bias"))


def _holders(recipe, name: str, row: dict) -> tuple[int, int]:
    """(ranks holding a piece of one of its matrices, ranks per replica group)."""
    p = recipe.parallelism
    t = p.tp if p.tp_enabled and tp_dim(name, recipe.model) is not None else 1
    g = row["group"] if p.fsdp_enabled else 1
    if ".experts." in name:
        return 1, t * g  # whole experts per rank; tp replicates them
    rows = row["shape"][0]
    chunk = -(-rows // g)
    return t * -(-rows // chunk), t * g


def muon_stage(recipe) -> list[dict[str, int]]:
    """Per pp rank: {"matrices", "buffer_numel" (this rank's momentum elements), "adamw_numel",
    "sent_bytes" (the stage's ranks together, per step), "owner_bytes" (mean per rank)}."""
    p = recipe.parallelism
    stage_ranks = p.world_size // p.pp
    ns = FP32 if recipe.optimizer.muon_ns_dtype == "float32" else BF16  # the pieces' and matrices' width
    full = param_shapes(recipe.model)
    out = [dict(matrices=0, buffer_numel=0, tensors=0, sent_bytes=0, owner_bytes=0) for _ in range(p.pp)]
    for name, row in param_table(recipe).items():
        # a tied head's or MTP's embedding copy on the last stage (lm_head.weight, mtp_embed_tokens) has no
        # row in the model's shapes, and is not a decoder layer's matrix
        if not (row["grad"] and name in full and is_muon(name, full[name])):
            continue
        s = out[row["stage"]]
        shape = full[name]
        count, numel = (shape[0], shape[1] * shape[2]) if len(shape) == 3 else (1, shape[0] * shape[1])
        holders, group = _holders(recipe, name, row)
        replicas = stage_ranks // group
        s["matrices"] += count
        s["tensors"] += 1
        s["buffer_numel"] += shard_numel(row["shape"], row["group"] if p.fsdp_enabled else 1)
        s["sent_bytes"] += replicas * count * 2 * ns * (numel - numel // holders)
        s["owner_bytes"] += replicas * count * numel * ns // stage_ranks
    return out


def optimizer_bytes(recipe, stage: int, params: int, tensors: int) -> int:
    """A rank's optimizer state: AdamW's two moments and fp32 step per parameter, or under
    muon one momentum buffer (no step) for Muon's; the moments in optimizer.state_dtype
    (fp32 4 B an element, bf16 2 B, 8bit: plan/state_bytes.py's blocks)."""
    width = moment_bytes(1, recipe.optimizer.state_dtype, blocks=False)  # fp32 4 B, bf16 2 B (8bit: below)
    adamw = 2 * params * width + tensors * FP32
    if recipe.optimizer.name == "muon":
        s = muon_stage(recipe)[stage]
        adamw -= s["buffer_numel"] * width + s["tensors"] * FP32
    if recipe.optimizer.state_dtype == "8bit":
        muon = recipe.optimizer.name == "muon"
        adamw -= int8_savings(recipe, stage, lambda name, shape: muon and is_muon(name, shape))
    return adamw
