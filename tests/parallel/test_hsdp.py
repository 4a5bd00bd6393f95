"""dp_mode hybrid (HSDP): the recipe checks at the door, the groups `plan` shows, and the
real process groups equal to them. (Loss parity: the combination matrix's hybrid runs,
tests/parallel/test_matrix.py.)"""

import json

from helpers import PARITY, cli_process, torchrun

from dtensor3d.mesh import rank_coords, rank_groups


def test_plan_shows_the_two_groups():
    out = cli_process(
        "plan", PARITY, "--json", "parallelism.dp=4", "parallelism.dp_mode=hybrid", "parallelism.dp_shard=2"
    )
    assert out.returncode == 0, out.stderr
    groups = json.loads(out.stdout)["groups"]
    assert groups["dp_shard"] == [[0, 1], [2, 3]]
    assert groups["dp_replicate"] == [[0, 2], [1, 3]]


def test_bad_dp_shard_is_one_line_at_the_door():
    for overrides, words in [
        (["parallelism.dp=4", "parallelism.dp_mode=hybrid", "parallelism.dp_shard=3"], "valid: 1, 2, 4"),
        (["parallelism.dp=4", "parallelism.dp_mode=hybrid"], "parallelism.dp_shard=0"),
        (["parallelism.dp=4", "parallelism.dp_shard=2"], "applies only with dp_mode: hybrid"),
    ]:
        out = cli_process("validate", PARITY, *overrides)
        assert out.returncode == 2, out
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], lines


def test_real_groups_match_the_rank_table():
    out = torchrun(8, ["tests/dist_scripts/hsdp_groups.py", "2"]).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    dims = {"ep": 1, "pp": 1, "dp": 4, "cp": 1, "tp": 2}
    table, coords = rank_groups(dims, dp_shard=2), rank_coords(dims)
    assert len(rows) == 8
    for row in rows:
        r = row["rank"]
        assert row["coords"] == coords[r]
        for name, ranks in row["groups"].items():
            assert ranks in table[name], (name, r, ranks)
            assert r in ranks
