"""Context-parallel attention: exact against single-device attention, and balanced."""

import json

from conftest import torchrun

from dtensor3d.parallel.context import attention_pairs, shard_sequence, zigzag_positions


def test_zigzag_layout():
    # 2*cp chunks; rank i holds chunks i and 2*cp-1-i; together the ranks hold every position once.
    assert zigzag_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    for cp in (1, 2, 4, 8):
        held = sorted(p for r in range(cp) for p in zigzag_positions(64, cp, r).tolist())
        assert held == list(range(64))
    import torch
    x = torch.arange(32).reshape(2, 16)
    assert shard_sequence(x, 2, 1).tolist() == [list(range(4, 12)), list(range(20, 28))]


def test_causal_work_is_balanced():
    for cp in (2, 4, 8):
        pairs = attention_pairs(4096, cp)
        assert max(pairs) / min(pairs) <= 1.05, pairs
        assert sum(pairs) == 4096 * 4097 // 2  # every causal pair scored exactly once


def test_cp_attention_matches_single_device():
    out = torchrun(4, ["tests/dist_scripts/cp_attention.py"]).stdout
    cases = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert {(c["cp"], c["kv_heads"]) for c in cases} == {(2, 4), (2, 2), (4, 4), (4, 2)}
    for c in cases:
        for key in ("out", "dq", "dk", "dv"):
            assert c[key] < 1e-5, c
