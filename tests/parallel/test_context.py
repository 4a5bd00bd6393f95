"""Context-parallel attention: exact against single-device attention, and balanced."""

import json
from functools import partial

import pytest
import torch
from helpers import torchrun

from dtensor3d.models.layers import causal_attention, document_attention
from dtensor3d.parallel.context import (
    KERNELS,
    attention_pairs,
    cp_kernel,
    flash_attention,
    shard_sequence,
    zigzag_positions,
)


def test_zigzag_layout():
    # 2*cp chunks; rank i holds chunks i and 2*cp-1-i; together the ranks hold every position once.
    assert zigzag_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    for cp in (1, 2, 4, 8):
        held = sorted(p for r in range(cp) for p in zigzag_positions(64, cp, r).tolist())
        assert held == list(range(64))
    x = torch.arange(32).reshape(2, 16)
    assert shard_sequence(x, 2, 1).tolist() == [list(range(4, 12)), list(range(20, 28))]


def test_causal_work_is_balanced():
    for cp in (2, 4, 8):
        pairs = attention_pairs(4096, cp)
        assert max(pairs) / min(pairs) <= 1.05, pairs
        assert sum(pairs) == 4096 * 4097 // 2  # every causal pair scored exactly once


def test_kernel_switch():
    # One switch, by device: the flash/log-sum-exp kernel where torch has it for CPU.
    has_flash = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    assert cp_kernel(torch.device("cpu")) == ("flash" if has_flash else "masked")
    assert cp_kernel(torch.device("cuda", 0)) == "masked"
    assert cp_kernel(torch.device("meta")) == "masked"


def _gathered(t, cp):
    return torch.cat([shard_sequence(t, cp, r, dim=2) for r in range(cp)], dim=2)


def _windowed(q, k, v, window):
    """Attention written out: query i sees keys i - window < j <= i (transformers' sliding window)."""
    s, rep = q.shape[2], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    ones = torch.ones(s, s, dtype=torch.bool)
    allowed = torch.tril(ones) & ~torch.tril(ones, -window)
    scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("window", [None, 5, 11])
def test_kernels_agree_on_gathered_keys(cp, kv_heads, window):
    # Both kernels, in one process, on every rank's queries against the gathered keys (what
    # cp_attention hands them after the all-gather): outputs and input gradients agree with
    # single-device causal attention and with each other. The gathered K/V gradients,
    # summed over ranks (the all-gather's backward), give the full dk, dv.
    g = torch.Generator().manual_seed(10 * cp + kv_heads)
    b, h, s, d = 2, 4, 32, 8
    # q as the model makes it: a [b, s, h, d] tensor viewed as [b, h, s, d]
    q = torch.randn(b, s, h, d, generator=g).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(b, kv_heads, s, d, generator=g, requires_grad=True) for _ in range(2))
    w = torch.randn(b, h, s, d, generator=g)
    ref = causal_attention(q, k, v, window)
    if window is not None:  # a window shorter than the chunks (5) and one across them (11)
        assert (ref - _windowed(q, k, v, window)).abs().max() < 1e-5
        assert (ref - causal_attention(q, k, v)).abs().max() > 0.1
    (ref * w).sum().backward()
    k_pos = torch.cat([zigzag_positions(s, cp, r) for r in range(cp)])
    got = {}
    for name, kernel in KERNELS.items():
        kg, vg = (_gathered(t.detach(), cp).requires_grad_() for t in (k, v))
        outs, dqs = [], []
        for rank in range(cp):
            ql = shard_sequence(q.detach(), cp, rank, dim=2).requires_grad_()
            q_pos = zigzag_positions(s, cp, rank)
            out = kernel(ql, kg, vg, q_pos=q_pos, k_pos=k_pos, cp=cp, rank=rank, window=window)
            (out * shard_sequence(w, cp, rank, dim=2)).sum().backward()
            outs.append(out.detach())
            dqs.append(ql.grad)
        got[name] = [torch.cat(outs, dim=2), torch.cat(dqs, dim=2), kg.grad, vg.grad]
        want = [_gathered(t, cp) for t in (ref.detach(), q.grad, k.grad, v.grad)]
        for key, x, y in zip(("out", "dq", "dk", "dv"), got[name], want):
            assert (x - y).abs().max() < 1e-5, (name, key, (x - y).abs().max())
    for x, y in zip(got["flash"], got["masked"]):
        assert (x - y).abs().max() < 1e-5


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("window", [None, 5])
def test_kernels_agree_with_attention_sinks(cp, window):
    # gpt-oss's sinks (one learned logit per head in each row's softmax, value zero): both
    # kernels on every rank's queries against the gathered keys match the attention written
    # out with the sink as one more column (the sink once per row, not once per chunk or block),
    # outputs and the gradients of q, k, v and the sinks (summed over ranks, as each rank's
    # copy of a replicated parameter is).
    g = torch.Generator().manual_seed(7 + cp)
    b, h, kv_heads, s, d = 2, 4, 2, 32, 8
    q = torch.randn(b, h, s, d, generator=g, requires_grad=True)
    k, v = (torch.randn(b, kv_heads, s, d, generator=g, requires_grad=True) for _ in range(2))
    sinks = torch.randn(h, generator=g).mul(2).requires_grad_()
    w = torch.randn(b, h, s, d, generator=g)
    kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    index = torch.arange(s)
    allowed = (index[None] <= index[:, None]) & (window is None or (index[None] > index[:, None] - (window or 0)))
    scores = (q @ kr.transpose(-1, -2) / d**0.5).masked_fill(~allowed, float("-inf"))
    scores = torch.cat([scores, sinks.view(1, h, 1, 1).expand(b, h, s, 1)], dim=-1)
    ref = scores.softmax(-1)[..., :-1] @ vr
    assert (ref - causal_attention(q, k, v, window)).abs().max() > 0.01  # the sinks take their share
    (ref * w).sum().backward()
    k_pos = torch.cat([zigzag_positions(s, cp, r) for r in range(cp)])
    for name, kernel in KERNELS.items():
        kg, vg = (_gathered(t.detach(), cp).requires_grad_() for t in (k, v))
        mine = sinks.detach().clone().requires_grad_()
        outs, dqs = [], []
        for rank in range(cp):
            ql = shard_sequence(q.detach(), cp, rank, dim=2).requires_grad_()
            where = {"q_pos": zigzag_positions(s, cp, rank), "k_pos": k_pos, "cp": cp, "rank": rank}
            out = kernel(ql, kg, vg, **where, window=window, sinks=mine)
            (out * shard_sequence(w, cp, rank, dim=2)).sum().backward()
            outs.append(out.detach())
            dqs.append(ql.grad)
        got = [torch.cat(outs, dim=2), torch.cat(dqs, dim=2), kg.grad, vg.grad, mine.grad]
        want = [*(_gathered(t, cp) for t in (ref.detach(), q.grad, k.grad, v.grad)), sinks.grad]
        for key, x, y in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
            assert (x - y).abs().max() < 1e-5, (name, key, (x - y).abs().max())


def _per_document(q, k, v, lengths, window=None):
    """Plain causal attention over each document alone (row by row): the reference."""
    rows = []
    for b, row in enumerate(lengths):
        edges = torch.tensor([0, *row]).cumsum(0).tolist()
        alone = causal_attention if window is None else partial(_windowed, window=window)
        parts = [alone(*(t[b : b + 1, :, i:j] for t in (q, k, v))) for i, j in zip(edges, edges[1:])]
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows)


# Documents of 1 to 14 tokens straddling the 2*cp chunks (the flash kernel cuts the keys no
# query of a chunk sees), and documents ending on chunk edges (it skips whole blocks).
PACKED = {"straddling": [[5, 1, 13, 3, 10], [2, 9, 7, 14]], "on_chunk_edges": [[4] * 8, [8, 4, 4, 4, 4, 8]]}


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("packing", list(PACKED))
@pytest.mark.parametrize("window", [None, 6])
def test_kernels_agree_on_packed_documents(cp, packing, window):
    # The single-device document attention and both cp kernels (each rank's queries against
    # the gathered keys and ids) give the outputs and gradients of each document run alone.
    g = torch.Generator().manual_seed(cp)
    b, h, kv, s, d = 2, 4, 2, 32, 8
    lengths = PACKED[packing]
    docs = torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in lengths])  # [b, s]
    q = torch.randn(b, s, h, d, generator=g).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(b, kv, s, d, generator=g, requires_grad=True) for _ in range(2))
    w = torch.randn(b, h, s, d, generator=g)
    ref = _per_document(q, k, v, lengths, window)
    want = [ref.detach(), *torch.autograd.grad((ref * w).sum(), (q, k, v))]
    single = document_attention(q, k, v, docs, window)
    got = {"single device": [single.detach(), *torch.autograd.grad((single * w).sum(), (q, k, v))]}
    k_pos = torch.cat([zigzag_positions(s, cp, r) for r in range(cp)])
    k_docs = torch.cat([shard_sequence(docs, cp, r) for r in range(cp)], dim=1)
    for name, kernel in KERNELS.items():
        kg, vg = (_gathered(t.detach(), cp).requires_grad_() for t in (k, v))
        outs, dqs = [], []
        for rank in range(cp):
            ql = shard_sequence(q.detach(), cp, rank, dim=2).requires_grad_()
            q_pos, q_docs = zigzag_positions(s, cp, rank), shard_sequence(docs, cp, rank)
            docs_here = {"q_docs": q_docs, "k_docs": k_docs, "window": window}
            out = kernel(ql, kg, vg, q_pos=q_pos, k_pos=k_pos, cp=cp, rank=rank, **docs_here)
            (out * shard_sequence(w, cp, rank, dim=2)).sum().backward()
            outs.append(out.detach())
            dqs.append(ql.grad)
        got[name] = [torch.cat(outs, dim=2), torch.cat(dqs, dim=2), kg.grad, vg.grad]
        got[name] = [_ungathered(t, cp) for t in got[name]]
    for name, tensors in got.items():
        for key, x, y in zip(("out", "dq", "dk", "dv"), tensors, want):
            assert (x - y).abs().max() < 1e-5, (name, key, (x - y).abs().max())
    assert (causal_attention(q, k, v) - ref).abs().max() > 0.1  # the documents do change the result


def _ungathered(t, cp):
    """The inverse of _gathered: cp-rank order back to sequence order (dim 2)."""
    s = t.shape[2]
    order = torch.cat([zigzag_positions(s, cp, r) for r in range(cp)])
    return t[:, :, torch.argsort(order)]


def test_flash_kernel_checks_the_layout():
    s, cp = 32, 2
    k = torch.randn(1, 2, s, 8)
    k_pos = torch.cat([zigzag_positions(s, cp, r) for r in range(cp)])
    with pytest.raises(ValueError, match="zigzag"):
        flash_attention(torch.randn(1, 2, s // cp, 8), k, k, q_pos=torch.arange(s // cp), k_pos=k_pos, cp=cp, rank=0)


def test_cp_attention_matches_single_device():
    out = torchrun(4, ["tests/dist_scripts/cp_attention.py"]).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    autocast = [c for c in rows if "autocast" in c]
    rows = [c for c in rows if "autocast" not in c]
    cases, windows = [c for c in rows if "window" not in c], [c for c in rows if "window" in c]
    # bf16 autocast, q and k fp32 and v bf16 (RoPE's and a linear's outputs): bf16 as SDPA under
    # autocast, no further from fp32 attention than single-device autocast is, up to bf16's rounding
    assert {(c["autocast"], c["window"]) for c in autocast} == {(k, w) for k in KERNELS for w in (None, 5)}
    for c in autocast:
        assert c["dtype"] == c["single_dtype"] == "torch.bfloat16", c
        assert c["err"] <= 2 * c["single_err"] + 2**-8, c
    # sliding windows: the tails-only gather where the window fits in a chunk, else the whole sequence
    assert {(c["cp"], c["window"], c["tails"]) for c in windows} == {
        (2, 3, 2),
        (2, 5, 4),
        (2, 9, 8),
        (4, 3, 2),
        (4, 5, 4),
        (4, 9, None),
    }
    assert {c["packed"] for c in windows} == {False, True}
    for c in windows:
        for key in ("out", "dq", "dk", "dv"):
            assert c[key] < 1e-5, c
    assert {(c["cp"], c["kv_heads"], c["v_dim"], c["kernel"]) for c in cases} == {
        (cp, kv, v_dim, kernel) for cp in (2, 4) for kv, v_dim in ((4, 8), (2, 8), (4, 6)) for kernel in KERNELS
    }
    for c in cases:
        for key in ("out", "dq", "dk", "dv"):
            assert c[key] < 1e-5, c
