"""tp_linear_async_communication (parallel/async_tp.py): parity with the key off and the
overlap itself (one 2-rank run, both tp modes), and which path the key takes where (no
processes: the switch's logic, the CUDA branch included)."""

import json
from types import SimpleNamespace

from helpers import PARITY, TOL, torchrun

from dtensor3d.parallel.tensor import tp_overlap, tp_plan


def test_async_tp_matches_the_key_off_and_overlaps():
    """tp 2, both tp modes, two steps each with the key off and on in one process pair: the
    loss and grad norm agree to TOL; with the key on, the tp collectives parallel/comm.py
    counts are issued asynchronously (a matmul runs between issue and wait): under ALL_REDUCE
    the input-gradient all-reduces, under sequence parallelism the chunked all-gathers and
    reduce-scatters. With the key off none is (DTensor waits before the next matmul)."""
    out = torchrun(2, ["tests/dist_scripts/async_tp.py", PARITY, "parallelism.tp=2", "training.micro_batch_size=2"])
    runs = {(r["mode"], r["async"]): r for r in map(json.loads, _lines(out.stdout))}
    assert len(runs) == 4, out.stdout[-2000:]
    for mode in ("ALL_REDUCE", "REDUCE_SCATTER"):
        off, on = runs[(mode, False)], runs[(mode, True)]
        for a, b in zip(off["metrics"], on["metrics"]):
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= TOL * abs(a[key]), (mode, key, a, b)
        assert sum(off["overlapped"]["tp"].values()) == 0, off
    assert runs[("ALL_REDUCE", True)]["overlapped"]["tp"]["all_reduce"] > 0
    sp = runs[("REDUCE_SCATTER", True)]["overlapped"]["tp"]
    assert sp["all_gather"] > 0 and sp["reduce_scatter"] > 0, sp
    # the chunked path issues more (smaller) collectives than DTensor's one per gather
    sp_off = runs[("REDUCE_SCATTER", False)]["issued"]["tp"]
    assert runs[("REDUCE_SCATTER", True)]["issued"]["tp"]["all_gather"] > sp_off["all_gather"]


def _lines(stdout: str) -> list[str]:
    return [line.removeprefix("ASYNC ") for line in stdout.splitlines() if line.startswith("ASYNC ")]


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
