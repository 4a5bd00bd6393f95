"""The sharding each parallel configuration promises, written from the plans' meaning (not
from the code that applies them), and the check of a run's `logging.layout` files.

Per parameter: which tensor dim each mesh axis splits, hence its local shape, and on
which pipeline stage it lives:
- tp: q/k/v, gate/up and the head split their output dim (0), o/down their input dim (1),
  the embedding its vocabulary (0); norms (replicated tp DTensors under sequence
  parallelism) and everything inside an MoE layer (router, experts, shared expert) are
  whole on every tp rank.
- ep: the stacked experts [E, in, out] split E (dim 0) over ep.
- fsdp (dp_mode shard): every parameter's dim 0 over ep x dp x cp (dense) or dp x cp
  (experts); hybrid: the same over the shard axis, replicated over dp_replicate;
  replicate: no data-parallel split at all.
- pp: a stage holds its own layers (balanced, earlier stages take the remainder, or
  pp_layers), the embedding on the first, the norm and head on the last.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from dtensor3d.config.schema import stage_layers
from dtensor3d.models import build_on_meta
from dtensor3d.plan.schedule_model import stage_rank

TP_DIM = {
    "self_attn.q_proj.weight": 0,
    "self_attn.k_proj.weight": 0,
    "self_attn.v_proj.weight": 0,
    "self_attn.o_proj.weight": 1,
    "mlp.gate_proj.weight": 0,
    "mlp.up_proj.weight": 0,
    "mlp.down_proj.weight": 1,
    "model.embed_tokens.weight": 0,
    "lm_head.weight": 0,
    # column-parallel biases split with their rows; row-parallel ones (o, down) are replicated
    "self_attn.q_proj.bias": 0,
    "self_attn.k_proj.bias": 0,
    "self_attn.v_proj.bias": 0,
    "mlp.gate_proj.bias": 0,
    "mlp.up_proj.bias": 0,
    "self_attn.o_proj.bias": None,
    "mlp.down_proj.bias": None,
}


def stage_of(name: str, cfg, p) -> set[int]:
    """The pipeline ranks that hold parameter `name` (with several stages per rank, the rank
    of the global stage that holds it: schedule_model.stage_rank)."""
    layers = stage_layers(cfg.num_hidden_layers, p.pp_stages, p.pp_layers)
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m:
        return {stage_rank(p, s) for s, r in enumerate(layers) if int(m[1]) in r}
    if name.startswith("model.embed_tokens"):
        return {0}
    return {stage_rank(p, p.pp_stages - 1)}  # final norm, head


def mesh_sizes(p) -> dict[str, int]:
    shard = p.dp_shard if p.dp_mode == "hybrid" else p.dp
    return {
        "tp": p.tp,
        "ep": p.ep,
        "dp_cp": p.dp * p.cp,
        "ep_dp_cp": p.ep * p.dp * p.cp,
        "dp_replicate": p.dp // shard,
        "dp_shard_cp": shard * p.cp,
        "ep_dp_shard_cp": p.ep * shard * p.cp,
    }


def expected_splits(name: str, p) -> dict[str, int | None]:
    """{mesh axis: tensor dim it splits (None: replicated over it)} of one parameter."""
    inside_moe = ".block_sparse_moe." in name
    expert = ".experts.w" in name
    splits: dict[str, int | None] = {}
    fsdp = p.dp_mode in ("shard", "hybrid") and p.ep * p.dp * p.cp > 1
    if fsdp and p.dp_mode == "hybrid":
        splits["dp_replicate"] = None
        splits["dp_shard_cp" if expert else "ep_dp_shard_cp"] = 0
    elif fsdp:
        splits["dp_cp" if expert else "ep_dp_cp"] = 0
    if expert and p.ep > 1:
        splits["ep"] = 0
    key = next((k for k in TP_DIM if name.endswith(k)), None)
    if p.tp > 1 and key is not None and not inside_moe:
        splits["tp"] = TP_DIM[key]
    if p.tp > 1 and p.tp_mode == "REDUCE_SCATTER" and name.endswith("norm.weight"):
        splits["tp"] = None  # sequence parallelism: norms are tp DTensors, replicated
    if p.tp > 1 and name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
        splits["tp"] = None  # per-head norms: replicated tp DTensors at either tp mode
    return splits


def actual_splits(entry: dict) -> dict[str, int | None]:
    out = {}
    for axis, placement in zip(entry["mesh"], entry["placements"]):
        m = re.search(r"S(?:hard)?\((?:dim=)?(\d+)", placement)
        out[axis] = int(m[1]) if m else None
    return out


def check_layout(run_dir: Path, recipe) -> int:
    """Assert every rank's layout file against the plan; returns the number of ranks checked."""
    p, cfg = recipe.parallelism, recipe.model
    full = {n: list(q.shape) for n, q in build_on_meta(cfg).named_parameters()}
    sizes, files = mesh_sizes(p), sorted((run_dir / "layout").glob("rank*.json"))
    assert len(files) == p.world_size, files
    for f in files:
        rank = json.loads(f.read_text())
        params, stage = rank["params"], rank["coords"]["pp"]
        assert set(params) == {n for n in full if stage in stage_of(n, cfg, p)}, (f.name, stage)
        for name, entry in params.items():
            want = expected_splits(name, p)
            assert actual_splits(entry) == want, (f.name, name, entry, want)
            assert entry["shape"] == full[name]
            for d, size in enumerate(full[name]):
                k = math.prod(sizes[a] for a, dim in want.items() if dim == d)
                local = entry["local_shape"][d]
                assert local == size // k if size % k == 0 else local <= -(-size // k), (f.name, name, d, entry)
    return len(files)


def _expected_comm(recipe, stage: int) -> dict[str, dict[str, int]]:
    from dtensor3d.plan.collectives import comm_bytes

    est = comm_bytes(recipe, backend="gloo")[stage]
    return {d: {k: v for k, v in kinds.items() if k != "total" and v} for d, kinds in est.items()}


def check_comm(run_dir: Path, recipe) -> None:
    """Every rank's bytes per collective kind and mesh dim in step 2 equal `plan`'s estimate
    exactly (dims sharing one process group, "a+b", against the sum of the two). Expert
    all-to-all bytes depend on the routing (the estimate assumes uniform): only checked to
    happen."""
    for f in sorted((run_dir / "layout").glob("rank*.json")):
        rank = json.loads(f.read_text())
        got, want = rank["comm_bytes"], _expected_comm(recipe, rank["coords"]["pp"])
        assert got is not None, f"{f.name}: no step-2 collective count"
        merged: dict[str, dict[str, int]] = {}
        for dims in got:
            for d in dims.split("+"):
                for kind, n in want.pop(d, {}).items():
                    merged.setdefault(dims, {}).setdefault(kind, 0)
                    merged[dims][kind] += n
        assert not any(want.values()), (f.name, "estimated but not measured", want)
        if recipe.parallelism.ep > 1:
            routed = [dims for dims in got if "ep" in dims.split("+")]
            assert routed and all(got[d].pop("all_to_all", 0) > 0 for d in routed), (f.name, got)
            for d in routed:
                merged[d].pop("all_to_all", None)
        got = {d: kinds for d, kinds in got.items() if kinds}
        merged = {d: kinds for d, kinds in merged.items() if kinds}
        assert got == merged, (f.name, rank["coords"], got, merged)
