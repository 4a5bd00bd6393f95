"""Torch-free facts about the pipeline schedules of parallel/pipeline.py, for `plan`'s
estimate: which stages each pp rank holds, how many microbatch-stages a rank keeps
activations for at once, which stage boundaries cross ranks, and the idle share (bubble).

The closed forms below are read off torch.distributed.pipelining's own computation orders
(`pipeline_order` of Schedule1F1B / ScheduleGPipe / ScheduleInterleaved1F1B /
ScheduleZBVZeroBubble / ScheduleDualPipeV); tests/plan/test_estimate.py rebuilds those orders
from torch's classes for many (pp, microbatches, stages per rank) and checks every formula
here against them.

Cost model of the bubble: every action of one stage (one microbatch through 1/v of the
rank's layers) costs one unit for its forward F, one for the backward to its input I and
one for the backward to its weights W (a full backward B = I + W = 2 units; an overlapped
F+B of dualpipev runs F then B: 3). Sends are free; an action starts when the rank is free
and its inputs are done (F after the previous stage's F of that microbatch, I/B after the
next stage's I/B and its own F, W after its I). The bubble is the rank's idle share of the
step: 1 - busy / makespan (every rank is equally busy: 3 v m units).
"""

from __future__ import annotations

from ..config.schema import V_SCHEDULES


def rank_stages(parallelism, pp_rank: int) -> list[int]:
    """The global stage indices pp rank `pp_rank` holds, in its schedule's order (the one
    rule; parallel/pipeline.local_stages builds from it): interleaved_1f1b loops (r, r + pp,
    ...), zbv and dualpipev fold a V (r and 2 pp - 1 - r), 1f1b and afab one stage (r)."""
    p = parallelism
    if not p.pp_enabled:
        return [0]
    if p.pp_engine in V_SCHEDULES:
        return [pp_rank, 2 * p.pp - 1 - pp_rank]
    return [pp_rank + k * p.pp for k in range(p.stages_per_rank)]


def stage_rank(parallelism, stage: int) -> int:
    """The pp rank that holds global stage `stage`."""
    p = parallelism
    if p.pp_engine in V_SCHEDULES and p.pp_enabled:
        return stage if stage < p.pp else 2 * p.pp - 1 - stage
    return stage % p.pp


def sends_per_microbatch(parallelism, pp_rank: int) -> int:
    """Residual-stream tensors this rank sends per microbatch: each of its stages' output to
    the next stage and its input's gradient to the previous one, where that stage lives on
    another rank (the V schedules hand stage pp - 1's output to stage pp on the same rank
    without a send; interleaved stages always cross ranks: v pp - 1 boundaries in all)."""
    p = parallelism
    if not p.pp_enabled:
        return 0
    last, sends = p.pp_stages - 1, 0
    for s in rank_stages(p, pp_rank):
        sends += s < last and stage_rank(p, s + 1) != pp_rank
        sends += s > 0 and stage_rank(p, s - 1) != pp_rank
    return sends


def weight_passes(parallelism, m: int, stage: int) -> int:
    """How many of a global stage's m microbatch backwards torch's order splits into a
    backward to the input (I) and a separate one to the weights (W): zbv every one;
    dualpipev only those outside its overlapped F+B steady state (whole backwards there), on
    pp rank r pp - ceil(r / 2) for its first stage (r) and pp - 1 - floor(r / 2) for its
    second (2 pp - 1 - r), whatever m (>= 2 pp); the other schedules none."""
    p = parallelism
    if not p.pp_enabled or p.pp_engine not in V_SCHEDULES:
        return 0
    if p.pp_engine == "zbv":
        return m
    r = stage_rank(p, stage)
    return p.pp - (r + 1) // 2 if stage < p.pp else p.pp - 1 - r // 2


def in_flight(parallelism, m: int, pp_rank: int) -> int:
    """The most microbatch-stages whose forward has run and whose backward (its weight part,
    W, under the zero-bubble schedules: torch keeps the graph until then) has not, on this
    rank at once (m microbatches per step):

    1f1b        min(m, pp - r)
    afab        m
    interleaved min(v m, w + 1), w = (v - 1) k + 2 (pp - 1 - r) its warmup forwards,
                k = m / max(1, m // pp) microbatches per round
    zbv         min(2 pp, m + 1 + r)
    dualpipev   2 pp + 1 (its overlapped F+B runs the forward first)

    The last stage (its loss backward follows its forward at once) never holds more than one."""
    p, r = parallelism, pp_rank
    if not p.pp_enabled:
        return 1
    match p.pp_engine:
        case "1f1b":
            return min(m, p.pp - r)
        case "afab":
            return m
        case "interleaved_1f1b":
            v, per_round = p.stages_per_rank, m // max(1, m // p.pp)
            return min(v * m, (v - 1) * per_round + 2 * (p.pp - 1 - r) + 1)
        case "zbv":
            return min(2 * p.pp, m + 1 + r)
        case "dualpipev":
            return 2 * p.pp + 1
    raise ValueError(f"pp_engine {p.pp_engine!r} has no in-flight formula")


def split_backward_states(parallelism, m: int, pp_rank: int) -> list[tuple[int, int]]:
    """Under zbv and dualpipev, whose backward runs to a stage's input first (I) and to its
    weights later (W): the (microbatch-stages awaiting I, microbatch-stages between I and W)
    pairs (k, w) at the rank's fullest moments. For every state torch's order passes through
    one of these has at least its w and at least its k + w, so with a microbatch-stage between
    I and W holding at least what it held before I, the memory peak is at one of them
    (n = in_flight; the drain runs along k + w = pp + r up to its largest w):

    zbv        (n, 0), (n - 1, 1) in the steady 1F-1I-1W, (pp - 1 - r, 2 r + 1) in the drain
    dualpipev  (n, 0), (n - 2, 1) but on the last rank, (pp - 1 - r, r + 1)

    Exact (each pair is reached) for zbv with m >= 2 pp - 1 and for dualpipev; for zbv with
    fewer microbatches an upper bound. Other schedules run whole backwards: [(n, 0)]."""
    p, r = parallelism, pp_rank
    n = in_flight(p, m, r)
    if not p.pp_enabled or p.pp_engine not in V_SCHEDULES:
        return [(n, 0)]
    if p.pp_engine == "zbv":
        return [(n, 0), (n - 1, 1), (p.pp - 1 - r, 2 * r + 1)]
    steady = [(n - 2, 1)] if r < p.pp - 1 else []  # the last rank's single I/W pairs come in its drain
    return [(n, 0), *steady, (p.pp - 1 - r, r + 1)]


def bubble_fraction(parallelism, m: int) -> float:
    """Idle share of a pipeline step under the unit cost model above (pp ranks p, m
    microbatches, v stages per rank):

    1f1b, afab   (p - 1) / (m + p - 1)
    interleaved  (p - 1) / (v m + p - 1)
    zbv          i / (6 m + i), i = p - 1 + max(0, 3 p - 2 m - 1) idle units: the fill and
                 drain (p - 1) of any pipeline, and for m < 3p/2 also warmup forwards that
                 wait on the V's turn
    dualpipev    (p - 1) / (6 m + p - 1)   (m >= 2p, which dualpipev requires)

    Not zero for zbv and dualpipev at finite m: the last rank cannot start before the first
    p - 1 forwards reach it, and the first waits as long for the drain."""
    p = parallelism
    pp = p.pp
    match p.pp_engine:
        case "1f1b" | "afab":
            return (pp - 1) / (m + pp - 1)
        case "interleaved_1f1b":
            return (pp - 1) / (p.stages_per_rank * m + pp - 1)
        case "zbv":
            idle = pp - 1 + max(0, 3 * pp - 2 * m - 1)
            return idle / (6 * m + idle)
        case "dualpipev":
            return (pp - 1) / (6 * m + pp - 1)
    raise ValueError(f"pp_engine {p.pp_engine!r} has no bubble formula")
