"""tp_linear_async_communication (parallel/async_tp.py): parity with the key off, eager and
compiled, at tp 2 and dp 2 x tp 2 in both tp modes, and the overlap itself (a 2-rank job and
a 4-rank job), and which path the key takes where (no processes: the switch's logic, the CUDA
branch included)."""

import json
from types import SimpleNamespace

import pytest
from helpers import COMPILE_TOL, PARITY, TOL, torchrun

from dtensor3d.parallel.tensor import tp_overlap, tp_plan

MODES = ("ALL_REDUCE", "REDUCE_SCATTER")
# Two decoder layers (the parity model has four): every path of the block twice over (block
# 0's input comes from the embedding, block 1's from a block) at half the compile time.
RUN = [PARITY, "parallelism.tp=2", "training.micro_batch_size=2", "model.num_hidden_layers=2"]


def async_runs(ranks: int, setups: str, *overrides: str) -> dict:
    """tests/dist_scripts/async_tp.py's records by (mode, setup)."""
    out = torchrun(ranks, ["tests/dist_scripts/async_tp.py", f"--setups={setups}", *RUN, *overrides])
    lines = [line.removeprefix("ASYNC ") for line in out.stdout.splitlines() if line.startswith("ASYNC ")]
    runs = {(r["mode"], r["setup"]): r for r in map(json.loads, lines)}
    assert len(runs) == len(MODES) * len(setups.split(",")), out.stdout[-2000:]
    return runs


@pytest.fixture(scope="module")
def tp2():
    """tp 2, both tp modes, two steps each with the key off, on, and on under training.compile,
    in one process pair."""
    return async_runs(2, "off,on,on_compiled")


def assert_matches(got: dict, ref: dict, tol: float) -> None:
    """got's two steps within tol of ref's; a compiled setup traced the blocks whole (no graph
    break at the overlapped Functions or their collectives' waits) into one graph both blocks
    reuse -- no guard on a block's own projections (until 2026-12-06 each block's
    functools.partial forward made it retrace) --, or two where this process's other tp mode
    traced first (REDUCE_SCATTER after ALL_REDUCE at dp 2: x's sequence dim 16 against 32)."""
    compiled = got["setup"] == "on_compiled"
    assert got["graph_breaks"] == 0 and got["graphs"] in ((1, 2) if compiled else (0,)), got
    if compiled and got["mode"] == "ALL_REDUCE":  # the first mode compiled in its process
        assert got["graphs"] == 1, got
    for a, b in zip(ref["metrics"], got["metrics"], strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= tol * abs(a[key]), (key, a, b)


def test_async_tp_matches_the_key_off_and_overlaps(tp2):
    """The loss and grad norm with the key on agree with the key off to TOL; with the key
    on, the tp collectives parallel/comm.py counts
    are issued asynchronously (a matmul runs between issue and wait): under ALL_REDUCE the
    input-gradient all-reduces, under sequence parallelism the chunked all-gathers and
    reduce-scatters, far more than with the key off."""
    for mode in MODES:
        off = tp2[(mode, "off")]
        assert_matches(tp2[(mode, "on")], off, TOL)
    # With the key off DTensor's collectives wait when their result is first used, so one may
    # have a matmul before it (counted: 1 all-reduce per step under ALL_REDUCE, measured); the
    # key on overlaps every group's input-gradient all-reduce and every chunked collective.
    ar_off, ar_on = (tp2[("ALL_REDUCE", k)]["overlapped"]["tp"].get("all_reduce", 0) for k in ("off", "on"))
    assert ar_on >= ar_off + 8, (ar_off, ar_on)  # 2 groups x 2 layers x 2 microbatches at least
    sp, sp_off = (tp2[("REDUCE_SCATTER", k)]["overlapped"]["tp"] for k in ("on", "off"))
    assert sp["all_gather"] > sp_off.get("all_gather", 0) and sp["reduce_scatter"] > sp_off.get("reduce_scatter", 0)
    print("overlapped tp collectives, key off -> on:", ar_off, ar_on, sp_off, sp)


def test_one_collective_in_flight_on_gloo():
    """On CUDA a sequence-parallel collective goes in CHUNKS pieces, issued at once; on gloo in
    one (two in flight on a gloo group corrupted the heap: 2 crashes and 1 hang in 6 runs)."""
    from dtensor3d.parallel.async_tp import CHUNKS, _chunks, _slices

    assert CHUNKS == 2 and _chunks(8, cuda=True) == 2 and _chunks(7, cuda=True) == 1
    assert _chunks(8, cuda=False) == 1 and _slices(8, cuda=False) == [slice(0, 8)]
    assert _slices(8, cuda=True) == [slice(0, 4), slice(4, 8)]


def test_async_tp_compiled_at_tp2(tp2):
    """tp 2, the key on under training.compile, both tp modes: each block one graph, within
    COMPILE_TOL of the key off, eager."""
    for mode in MODES:
        assert_matches(tp2[(mode, "on_compiled")], tp2[(mode, "off")], COMPILE_TOL)


def test_async_tp_at_dp2_tp2_eager_and_compiled(tp2):
    """dp 2 x tp 2 (FSDP2 over the overlapped projections' DTensor weights, outside the
    compiled blocks), the key on, eager and under training.compile, both tp modes: within TOL
    (eager) and COMPILE_TOL (compiled) of tp 2 with the key off, eager (the same global
    batches: topology independence)."""
    got = async_runs(4, "on,on_compiled", "parallelism.dp=2")
    for mode in MODES:
        assert_matches(got[(mode, "on")], tp2[(mode, "off")], TOL)
        assert_matches(got[(mode, "on_compiled")], tp2[(mode, "off")], COMPILE_TOL)


def test_the_async_key_picks_its_path_per_device():
    """Key off or tp 1: nothing. CUDA with compile under sequence parallelism: torch's
    micro-pipeline TP over the synchronous plan. Otherwise (CPU, eager, ALL_REDUCE): the
    chunked Functions, and the plan leaves their projections out."""

    def p(key=True, tp=2, sp=True):
        return SimpleNamespace(tp_linear_async_communication=key, tp_enabled=tp > 1, sequence_parallel=sp)

    assert tp_overlap(p(key=False), "cuda", True) is None
    assert tp_overlap(p(tp=1), "cpu", False) is None
    assert tp_overlap(p(), "cuda", True) == "micro_pipeline"
    assert tp_overlap(p(sp=False), "cuda", True) == "chunked"
    assert tp_overlap(p(), "cuda", False) == "chunked"
    assert tp_overlap(p(), "cpu", True) == "chunked"
    sync, chunked = tp_plan(True)[1], tp_plan(True, overlapped=True)[1]
    assert {"self_attn.q_proj", "mlp.down_proj", "self_attn", "mlp"} <= set(sync)
    assert set(chunked) == set(sync) - {
        *("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn"),
        *("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp"),
    }
    # ALL_REDUCE: the row-parallel outputs keep torch's RowwiseParallel (all-reduce forward)
    assert set(tp_plan(False, overlapped=True)[1]) >= {"self_attn.o_proj", "mlp.down_proj"}


def test_a_weight_backward_sends_no_input_gradient():
    """pipelining's split weight backward (zbv, dualpipev: autograd.grad to the weights alone)
    runs a column group's backward without its input gradient: no all-reduce, the same weight
    gradients (it used to all-reduce the input gradient again and drop it). One process, a
    real one-rank gloo group; the whole backward and one to the input still all-reduce once."""
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from dtensor3d.parallel.async_tp import _ColumnGroup

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.all_reduces = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.all_reduces += func._schema.name == "_c10d_functional::all_reduce"
            return func(*args, **(kwargs or {}))

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = torch.randn(2, 4, 8, requires_grad=True) * 1.0  # not a leaf: the engine's node
        w = [torch.randn(6, 8, requires_grad=True) for _ in range(2)]
        ys = _ColumnGroup.apply(x, dist.group.WORLD.group_name, 1, 0, False, w[0], None, w[1], None)
        loss = sum((y * y).sum() for y in ys)
        got = {}
        for name, inputs in (("weights", w), ("input", [x]), ("whole", [x, *w])):
            with Count() as count:
                got[name] = (torch.autograd.grad(loss, inputs, retain_graph=True), count.all_reduces)
    finally:
        dist.destroy_process_group()
    assert [got[k][1] for k in ("weights", "input", "whole")] == [0, 1, 1]
    for a, b in zip(got["weights"][0], got["whole"][0][1:], strict=True):
        assert torch.equal(a, b)
