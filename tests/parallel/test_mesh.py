"""The 5-D rank layout: the pure table against nanotron's formula, and real gloo meshes
against the pure table."""

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dtensor3d.mesh import AXES, FLAT_VIEWS, rank_coords, rank_groups

REPO = Path(__file__).resolve().parents[2]


def factorizations(n: int, parts: int = 5):
    """Every ordered tuple of `parts` positive integers whose product is n."""
    if parts == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in factorizations(n // d, parts - 1):
                yield (d, *rest)


ALL_DIMS = [dict(zip(AXES, f)) for n in (16, 24) for f in factorizations(n)]


def test_factorizations_are_complete():
    # 16 = 2^4 into 5 ordered factors: C(8, 4) = 70; 24 = 2^3 * 3: C(7, 4) * C(5, 4) = 175.
    assert len(list(factorizations(16))) == 70
    assert len(list(factorizations(24))) == 175


def expected_groups(dims: dict[str, int]) -> dict[str, list[list[int]]]:
    """Groups by explicit coordinate loops. Rank of coordinate (ep, pp, dp, cp, tp) is
    ((((ep * PP + pp) * DP + dp) * CP + cp) * TP + tp): nanotron's arange(world).reshape(ep, pp,
    dp, cp, tp). A group fixes every other axis and varies its own axes, first axis slowest;
    groups come in the order of the fixed coordinates (mesh order, last fastest)."""
    sizes = [dims[a] for a in AXES]

    def rank(coord):
        r = 0
        for c, s in zip(coord, sizes):
            r = r * s + c
        return r

    out = {}
    for name, axes in [(a, (a,)) for a in AXES] + list(FLAT_VIEWS.items()):
        varying = [AXES.index(a) for a in axes]
        fixed = [i for i in range(len(AXES)) if i not in varying]
        groups = []
        for fixed_coord in itertools.product(*(range(sizes[i]) for i in fixed)):
            group = []
            for var_coord in itertools.product(*(range(sizes[i]) for i in varying)):
                coord = [0] * len(AXES)
                for i, c in zip(fixed, fixed_coord):
                    coord[i] = c
                for i, c in zip(varying, var_coord):
                    coord[i] = c
                group.append(rank(coord))
            groups.append(group)
        out[name] = groups
    return out


def nanotron_groups(dims: dict[str, int]) -> dict[str, list[list[int]]]:
    """The transposes nanotron's ParallelContext uses (tp, cp, dp, pp; ep by the same
    pattern), each group listed in nanotron's own order."""
    ep, pp, dp, cp, tp = (dims[a] for a in AXES)
    ranks = np.arange(ep * pp * dp * cp * tp).reshape(ep, pp, dp, cp, tp)
    return {
        "tp": ranks.transpose((0, 1, 2, 3, 4)).reshape(-1, tp).tolist(),
        "cp": ranks.transpose((4, 0, 1, 2, 3)).reshape(-1, cp).tolist(),
        "dp": ranks.transpose((3, 4, 0, 1, 2)).reshape(-1, dp).tolist(),
        "pp": ranks.transpose((2, 3, 4, 0, 1)).reshape(-1, pp).tolist(),
        "ep": ranks.transpose((1, 2, 3, 4, 0)).reshape(-1, ep).tolist(),
    }


def _name(dims):
    return "-".join(f"{a}{dims[a]}" for a in AXES)


@pytest.mark.parametrize("dims", ALL_DIMS, ids=_name)
def test_rank_groups_match_nanotron_layout(dims):
    got = rank_groups(dims)
    world = int(np.prod([dims[a] for a in AXES]))
    assert got == expected_groups(dims)
    # nanotron lists groups in another order; the group each rank belongs to (with its
    # members in axis order) must be the same.
    for axis, groups in nanotron_groups(dims).items():
        assert sorted(got[axis]) == sorted(groups), axis
    for name, groups in got.items():
        assert sorted(r for g in groups for r in g) == list(range(world)), name  # a partition
    coords = rank_coords(dims)
    for r, c in enumerate(coords):
        for axis in AXES:
            group = next(g for g in got[axis] if r in g)
            assert group.index(r) == c[axis]  # position in the group is the axis coordinate


def test_rank_groups_3d_by_hand():
    # dp 2 x pp 2 x tp 2, written out: rank = pp*4 + dp*2 + tp.
    g = rank_groups({"ep": 1, "pp": 2, "dp": 2, "cp": 1, "tp": 2})
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["cp"] == [[r] for r in range(8)]
    assert g["ep"] == [[r] for r in range(8)]
    assert g["dp_cp"] == g["dp"]


# ---- real gloo meshes (one 8-rank job for the whole module) -----------------------------


@pytest.fixture(scope="module")
def dist_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh") / "groups.json"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "8",
            str(REPO / "tests" / "dist_scripts" / "mesh_groups.py"),
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(out.read_text())
    assert [r["rank"] for r in report["ranks"]] == list(range(8))
    assert all(r["world"] == 8 for r in report["ranks"])
    return report


def test_device_mesh_groups_equal_rank_groups(dist_report):
    assert len(dist_report["dims"]) == 3
    for name, dims in dist_report["dims"].items():
        table = rank_groups(dims)
        coords = rank_coords(dims)
        for rank, r in enumerate(dist_report["ranks"]):
            got = r["meshes"][name]
            assert got["coordinate"] == [coords[rank][a] for a in AXES], (name, rank)
            assert set(got["groups"]) == set(AXES) | set(FLAT_VIEWS)
            for axis, ranks in got["groups"].items():
                mine = [g for g in table[axis] if rank in g]
                assert len(mine) == 1
                # The process group holds the same ranks; DeviceMesh lists them in mesh order.
                assert ranks == mine[0], (name, axis, rank)


def test_device_mesh_dp_cp_joins_dp_and_cp(dist_report):
    r0 = dist_report["ranks"][0]["meshes"]["dp2_cp2_tp2"]["groups"]
    # rank = dp*4 + cp*2 + tp
    assert r0["dp"] == [0, 4] and r0["cp"] == [0, 2] and r0["tp"] == [0, 1]
    assert r0["dp_cp"] == [0, 2, 4, 6]
    r5 = dist_report["ranks"][5]["meshes"]["dp2_cp2_tp2"]["groups"]
    assert r5["dp_cp"] == [1, 3, 5, 7]


def test_parallel_context_3d(dist_report):
    """nanotron's 3-D check: tp=2, pp=2, dp=2 on 8 ranks."""
    table = rank_groups({"ep": 1, "pp": 2, "dp": 2, "cp": 1, "tp": 2})
    for rank, r in enumerate(dist_report["ranks"]):
        c = r["context"]
        for axis in ("tp", "pp", "dp"):
            mine = next(g for g in table[axis] if rank in g)
            assert c[f"{axis}_pg"] == mine, (axis, rank)
            assert c[f"{axis}_ranks"] == mine
            # all_reduce of 1 << rank over the group: exactly the members' bits are set.
            assert c[f"{axis}_sum"] == sum(1 << m for m in mine), (axis, rank)
        assert c["world_sum"] == 2**8 - 1
        assert c["global_rank"] == rank
        assert c["coords"] == {"ep": 0, "pp": rank // 4, "dp": rank // 2 % 2, "cp": 0, "tp": rank % 2}
        assert c["sizes"] == [2, 2, 2, 1, 1]
    # Spelled out for rank 0 and rank 7, as nanotron's README prints them.
    assert dist_report["ranks"][0]["context"]["tp_pg"] == [0, 1]
    assert dist_report["ranks"][0]["context"]["pp_pg"] == [0, 4]
    assert dist_report["ranks"][0]["context"]["dp_pg"] == [0, 2]
    assert dist_report["ranks"][7]["context"]["tp_sum"] == (1 << 6) + (1 << 7)
