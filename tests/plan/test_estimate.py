"""dtensor3d/estimate.py: the analytical cost of a step, checked by hand-counted shapes and
against what real ranks hold and hand to collectives (counted by intercepting them)."""

import json

import pytest
from helpers import PARITY, ROOT, torchrun

from dtensor3d.config.load import load_recipe
from dtensor3d.plan.collectives import comm_bytes
from dtensor3d.plan.estimate import estimate, reshard_here
from dtensor3d.plan.memory import bubble_fraction, in_flight
from dtensor3d.plan.params import KINDS, param_table, shard_numel

# The parity recipe's parameter shapes (vocab 256, hidden 64, 8 heads / 4 kv heads of 8, inter 128).
EMBED, LAYER_SHAPES, NORM = [256, 64], [[64, 64], [32, 64], [32, 64], [64, 64], [128, 64], [128, 64], [64, 128]], [64]


def recipe(*overrides):
    return load_recipe(PARITY, list(overrides))


def test_params_world1_is_the_model():
    est = estimate(recipe())
    per_layer = sum(a * b for a, b in LAYER_SHAPES) + 2 * 64
    assert [s["params"] for s in est["stages"]] == [4 * per_layer + 2 * 256 * 64 + 64]
    s = est["stages"][0]
    assert s["param_bytes"] == s["grad_bytes"] == 4 * s["params"]
    # AdamW: two fp32 moments per element and one fp32 step scalar per tensor (4 x 9 + 3 tensors)
    assert s["optimizer_bytes"] == 8 * s["params"] + 4 * 39


def test_optimizer_bytes_per_state_dtype():
    """optimizer.state_dtype: bf16 moments 2 B an element; 8bit, for each parameter of >= 4 096
    elements (embedding, head; per layer q/o/gate/up/down), 1 B codes + one fp32 scale per 256 +
    a 1 KiB code map per moment, fp32 for the rest (k/v, norms). Measured on these ranks: equal
    (world 1: 1,446,556 / 723,356 / 513,692 bytes; dp 2: 723,356 / 361,756 / 279,452)."""
    fp32 = estimate(recipe())["stages"][0]
    params, steps = fp32["params"], 4 * 39
    assert estimate(recipe("optimizer.state_dtype=bfloat16"))["stages"][0]["optimizer_bytes"] == 4 * params + steps
    big = [256 * 64] * 2 + [64 * 64, 64 * 64, 128 * 64, 128 * 64, 64 * 128] * 4
    saved = sum(2 * (4 * n - (n + n // 64 + 1024)) for n in big)
    assert estimate(recipe("optimizer.state_dtype=8bit"))["stages"][0]["optimizer_bytes"] == 8 * params + steps - saved


def test_params_fsdp_uneven_rows_are_padded():
    """dp 3: FSDP2 cuts dim 0 in chunks of ceil(d0 / 3); rank 0 holds a whole chunk."""
    est = estimate(recipe("parallelism.dp=3", "training.global_batch_size=3"))
    rows = lambda shape: -(-shape[0] // 3) * (shape[1] if len(shape) > 1 else 1)  # noqa: E731
    layer = sum(rows(s) for s in LAYER_SHAPES) + 2 * rows(NORM)
    assert est["stages"][0]["params"] == 4 * layer + 2 * rows(EMBED) + rows(NORM)
    assert shard_numel([32, 64], 3) == 11 * 64 and shard_numel([2, 5], 3) == 5 and shard_numel([0, 5], 3) == 0


def test_params_tp_pp_split_the_plan_way():
    """tp 2 x pp 2: colwise q/k/v/gate/up and the head split dim 0, rowwise o/down dim 1,
    the embedding its vocabulary; norms whole. Stage 0 has the embedding, stage 1 the head."""
    est = estimate(recipe("parallelism.tp=2", "parallelism.pp=2", "training.global_batch_size=2"))
    layer = sum(a * b for a, b in LAYER_SHAPES) // 2 + 2 * 64
    assert [s["params"] for s in est["stages"]] == [2 * layer + 128 * 64, 2 * layer + 128 * 64 + 64]


def test_bubble_and_microbatches_in_flight():
    r = recipe("parallelism.pp=4", "training.global_batch_size=8")
    assert bubble_fraction(r) == pytest.approx(3 / 11)
    assert [in_flight(r, s) for s in range(4)] == [4, 3, 2, 1]
    r = recipe("parallelism.pp=2", "parallelism.pp_engine=afab", "training.global_batch_size=8")
    assert [in_flight(r, s) for s in range(2)] == [8, 8]
    assert in_flight(recipe(), 0) == 1 and bubble_fraction(recipe()) == 0.0


def test_recompute_keeps_less_and_talks_more():
    plain = estimate(recipe("parallelism.tp=2", "training.global_batch_size=2"))["stages"][0]
    again = estimate(recipe("parallelism.tp=2", "training.global_batch_size=2", "parallelism.recompute_layer=true"))
    again = again["stages"][0]
    assert again["activation_bytes"] < plain["activation_bytes"]
    assert again["comm_bytes_per_step"]["tp"]["all_reduce"] > plain["comm_bytes_per_step"]["tp"]["all_reduce"]


def test_step_time_from_peak_and_mfu():
    r = recipe("parallelism.dp=2")
    est = estimate(r, peak_tflops=100.0, mfu=0.5)
    assert est["step_time_s"] == pytest.approx(est["flops_per_step"] / (2 * 100e12 * 0.5))
    assert est["tokens_per_sec"] == pytest.approx(8 * 32 / est["step_time_s"])


# Every parity run (tests/parallel/test_parity.py, tests/parallel/test_moe_parity.py) already checks each
# rank's bytes per collective against the estimate (tests/helpers.py check_comm). The mesh
# below is the one they lack: FSDP2 with uneven shards (dp 3), whose padding the estimate
# must count. It runs 2 steps on 3 CPU ranks; step 2 is counted. In bf16 with training.float8
# tensorwise (FSDP2 gathers the converted weights in float8, 1 byte an element, and all-reduces
# their scales) and bf16 optimizer states (optimizer.state_dtype: 4 B a parameter); hidden 96, so
# that the layers' weights split evenly over 3 (the float8 all-gather needs it: the door's
# check_float8_gather) while the embedding's and the head's 256 rows do not (86, 86, 84: padded).
MEASURED = {
    "dp3_uneven": [
        "parallelism.dp=3",
        "training.global_batch_size=3",
        "training.dtype=bfloat16",
        "training.float8={recipe: tensorwise}",
        "optimizer.state_dtype=bfloat16",
        "model.hidden_size=96",
        "model.intermediate_size=192",
    ],
}


@pytest.mark.parametrize("name", list(MEASURED))
def test_estimate_equals_measured(name):
    """Every rank's bytes per collective kind and mesh dim, and rank 0 of each stage's
    parameters, gradients and optimizer state, equal the estimate exactly."""
    overrides = (["training.global_batch_size=4"] if "dp3" not in name else []) + MEASURED[name]
    r = recipe(*overrides)
    world = r.parallelism.world_size
    out = torchrun(world, [str(ROOT / "tests/dist_scripts/comm_bytes.py"), PARITY, *overrides], timeout=900).stdout
    # ranks print concurrently: lines may run together, so decode from each "COMM " marker
    ranks = [json.JSONDecoder().raw_decode(piece)[0] for piece in out.split("COMM ")[1:]]
    assert len(ranks) == world
    r = reshard_here(r)[0]  # fsdp_reshard_after_forward auto, decided as the run decides it
    comm, stages = comm_bytes(r, backend="gloo"), estimate(r, backend="gloo")["stages"]
    for rank in ranks:
        stage = rank["coords"]["pp"]
        expected = {d: {k: kinds[k] for k in KINDS if kinds[k]} for d, kinds in comm[stage].items() if kinds["total"]}
        assert rank["bytes"] == expected, (rank["rank"], rank["coords"])
        if rank["coords"]["dp"] == rank["coords"]["cp"] == rank["coords"]["ep"] == 0:
            for key in ("params", "param_bytes", "grad_bytes", "optimizer_bytes"):
                assert rank[key] == stages[stage][key], (key, rank["rank"])


# -- pipeline schedules: the closed forms of dtensor3d/schedule_model.py against torch's orders --


def torch_order(p, m: int) -> dict[int, list]:
    """{pp rank: its compute actions in order} as torch's schedule class for the recipe's
    pp_engine computes them (its own _calculate_single_rank_operations / _get_pipeline_order,
    called on a stand-in object: no process group, no stages). 1f1b's runtime does not follow
    its IR: its order is written from Schedule1F1B._step_microbatches (min(m, pp - r) warmup
    forwards, then backward-forward pairs, then the remaining backwards)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import _Action
    from torch.distributed.pipelining.schedules import _ComputationType as C

    from dtensor3d.parallel.pipeline import schedule_class

    if p.pp_engine == "1f1b":
        out = {}
        for r in range(p.pp):
            warm = min(m, p.pp - r)
            acts = [_Action(r, C.FORWARD, i) for i in range(warm)]
            for i in range(m):
                acts.append(_Action(r, C.FULL_BACKWARD, i))
                acts += [_Action(r, C.FORWARD, i + warm)] if i + warm < m else []
            out[r] = acts
        return out
    v, rounds = p.stages_per_rank, max(1, m // p.pp)
    fake = SimpleNamespace(
        pp_group_size=p.pp, n_local_stages=v, microbatches_per_round=m // rounds, _n_microbatches=m,
        num_stages=v * p.pp, _num_stages=p.pp,
    )  # fmt: skip
    cls = schedule_class(p.pp_engine).__mro__[-3] if p.pp_engine != "afab" else schedule_class("afab")
    if p.pp_engine == "afab":
        order = cls._get_pipeline_order(fake)
    else:
        cls = next(k for k in schedule_class(p.pp_engine).__mro__ if "_calculate_single_rank_operations" in k.__dict__)
        order = {r: cls._calculate_single_rank_operations(fake, r) for r in range(p.pp)}
    return {
        r: [a for a in acts if a is not None and a.computation_type.name != "REDUCE_GRAD"] for r, acts in order.items()
    }


def compute_actions(actions):
    """Sub-actions of overlapped F+B in order (F first), the rest as they are."""
    for a in actions:
        yield from a.sub_actions or (a,)


def peaks_in_flight(actions) -> tuple[int, dict[int, int]]:
    """(most forwards whose full backward or weight backward has not run, the same per stage)."""
    total, best, per, best_per = 0, 0, {}, {}
    for a in compute_actions(actions):
        kind, s = a.computation_type.name, a.stage_index
        step = 1 if kind == "FORWARD" else -1 if kind in ("FULL_BACKWARD", "BACKWARD_WEIGHT") else 0
        total, per[s] = total + step, per.get(s, 0) + step
        best, best_per[s] = max(best, total), max(best_per.get(s, 0), per[s])
    return best, best_per


COST = {"FORWARD": 1, "BACKWARD_INPUT": 1, "BACKWARD_WEIGHT": 1, "FULL_BACKWARD": 2}


def idle_share(order: dict[int, list], stages: int) -> float:
    """Run the order with unit costs (schedule_model's cost model): each rank takes its next
    action when its inputs are done; the idle share of the makespan, equal on every rank."""
    acts = {r: list(compute_actions(a)) for r, a in order.items()}
    done, free, pos = {}, dict.fromkeys(acts, 0), dict.fromkeys(acts, 0)
    while any(pos[r] < len(acts[r]) for r in acts):
        moved = False
        for r in acts:
            while pos[r] < len(acts[r]):
                a = acts[r][pos[r]]
                kind, s, i = a.computation_type.name, a.stage_index, a.microbatch_index
                if kind == "FORWARD":
                    key, deps = ("F", s, i), [("F", s - 1, i)] if s else []
                elif kind == "BACKWARD_WEIGHT":
                    key, deps = ("W", s, i), [("B", s, i)]
                else:
                    key, deps = ("B", s, i), [("F", s, i)] + ([("B", s + 1, i)] if s < stages - 1 else [])
                if any(d not in done for d in deps):
                    break
                free[r] = done[key] = max([free[r]] + [done[d] for d in deps]) + COST[kind]
                pos[r], moved = pos[r] + 1, True
        assert moved, "the order deadlocks"
    busy = {r: sum(COST[a.computation_type.name] for a in acts[r]) for r in acts}
    assert len(set(busy.values())) == 1
    return 1 - busy[0] / max(free.values())


def count_sends(p, r: int, actions) -> int:
    """Residual-stream sends of rank r: a forward to a next stage, a backward to a previous
    stage, held by another rank."""
    from dtensor3d.plan.schedule_model import stage_rank

    sends, last = 0, p.pp_stages - 1
    for a in compute_actions(actions):
        kind, s = a.computation_type.name, a.stage_index
        if kind == "FORWARD":
            sends += s < last and stage_rank(p, s + 1) != r
        elif kind in ("FULL_BACKWARD", "BACKWARD_INPUT"):
            sends += s > 0 and stage_rank(p, s - 1) != r
    return sends


def schedule_cases():
    from dtensor3d.config.checks import _micro_ok
    from dtensor3d.config.schema import ParallelismConfig

    for engine, vs in (("1f1b", [0]), ("afab", [0]), ("interleaved_1f1b", [2, 3, 4]), ("zbv", [0]), ("dualpipev", [0])):
        for pp in (2, 3, 4, 8):
            for v in vs:
                p = ParallelismConfig(pp=pp, pp_engine=engine, pp_virtual_stages=v)
                for m in range(1 if engine == "afab" else pp, 3 * pp + 2):
                    if p.stages_per_rank == 1 or _micro_ok(p, m):
                        yield p, m


def test_schedule_formulas_match_torch_orders():
    """For every schedule, pp 2/3/4/8, v 2-4 (interleaved) and every microbatch count the
    door lets through up to 3 pp + 1: the stages each rank runs, the microbatch-stages in
    flight (the last stage never more than one), the sends per microbatch and the bubble
    under the unit cost model equal schedule_model's closed forms exactly."""
    from dtensor3d.parallel.pipeline import local_stages
    from dtensor3d.plan.schedule_model import bubble_fraction, in_flight, rank_stages, sends_per_microbatch

    checked = 0
    for p, m in schedule_cases():
        order, last = torch_order(p, m), p.pp_stages - 1
        for r, actions in order.items():
            assert rank_stages(p, r) == local_stages(r, p)
            assert {a.stage_index for a in compute_actions(actions)} == set(rank_stages(p, r))
            total, per_stage = peaks_in_flight(actions)
            assert in_flight(p, m, r) == total, (p.pp_engine, p.pp, p.stages_per_rank, m, r)
            assert per_stage.get(last, 0) <= 1 or p.pp_engine == "afab"
            sends = count_sends(p, r, actions)
            assert sends == m * sends_per_microbatch(p, r)
        assert bubble_fraction(p, m) == pytest.approx(idle_share(order, p.pp_stages), abs=1e-12), (p.pp_engine, m)
        checked += 1
    assert checked > 100


def test_schedule_formulas_by_hand():
    """A few values worked out on paper from torch's orders (pp 4, 8 microbatches)."""

    def est(engine, *more):
        overrides = ["parallelism.pp=4", f"parallelism.pp_engine={engine}", "training.global_batch_size=8"]
        return recipe(*overrides, "model.num_hidden_layers=16", *more)

    assert bubble_fraction(est("interleaved_1f1b")) == pytest.approx(3 / 19)  # (p-1)/(v m + p-1)
    assert bubble_fraction(est("interleaved_1f1b", "parallelism.pp_virtual_stages=4")) == pytest.approx(3 / 35)
    assert bubble_fraction(est("zbv")) == pytest.approx(3 / 51)  # i = 3 idle units of 6 m + i
    assert bubble_fraction(est("dualpipev")) == pytest.approx(3 / 51)
    assert bubble_fraction(est("afab")) == bubble_fraction(est("1f1b")) == pytest.approx(3 / 11)
    # interleaved v 2, 2 rounds of 4: warmup 4 + 2 (3 - r) forwards, then one more before the first backward
    assert [in_flight(est("interleaved_1f1b"), r) for r in range(4)] == [11, 9, 7, 5]
    assert [in_flight(est("zbv"), r) for r in range(4)] == [8, 8, 8, 8]
    assert [in_flight(est("dualpipev"), r) for r in range(4)] == [9, 9, 9, 9]


def test_selective_recompute_keeps_the_matmul_outputs():
    """Per layer of the parity model (32 tokens, hidden 64, q 64, k/v 32, inter 128, 8 heads,
    fp32), selective keeps the layer input 8,192 B + q/k/v 16,384 + attention output 8,192 +
    log-sum-exp 1,024 + o_proj 8,192 + gate/up/down 40,960 = 82,944 B; the rest of a layer
    (140,288 B unrecomputed) is alive once, while one layer is recomputed in backward."""
    from dtensor3d.plan.memory import layer_activation_bytes, layers_activation_bytes, selective_layer_bytes

    r = recipe("parallelism.recompute=selective")
    assert selective_layer_bytes(r, False) == 82_944 and layer_activation_bytes(r, False) == 140_288
    assert layers_activation_bytes(r, range(4)) == (4 * 82_944, 140_288 - 82_944)
    assert layers_activation_bytes(recipe("parallelism.recompute=full"), range(4)) == (4 * 8_192, 140_288)
    assert layers_activation_bytes(recipe(), range(4)) == (4 * 140_288, 0)
    # selective replays the forward's collectives as full does (the gathered inputs are not kept)
    tp2 = ["parallelism.tp=2", "training.global_batch_size=2"]
    sel, full = (comm_bytes(recipe(*tp2, f"parallelism.recompute={m}"))[0]["tp"] for m in ("selective", "full"))
    assert sel == full != comm_bytes(recipe(*tp2))[0]["tp"]


def test_pp_bytes_count_the_boundaries_that_cross_ranks():
    """pp 2, 8 microbatches of 32 x 64 fp32 (8,192 B): interleaved v 2 crosses 3 boundaries
    (rank 0 sends 0->1 and 2->3 forward, 2->1 backward: 3 sends per microbatch); zbv's V hands
    stage 1 to stage 2 on rank 1 without a send (each rank: 2 sends per microbatch)."""
    pp2 = ["parallelism.pp=2", "training.global_batch_size=8"]
    sends = lambda engine: [c["pp"]["send_recv"] // (8 * 8_192) for c in comm_bytes(recipe(*pp2, engine))]  # noqa: E731
    assert sends("parallelism.pp_engine=1f1b") == [1, 1]
    assert sends("parallelism.pp_engine=interleaved_1f1b") == [3, 3]
    assert sends("parallelism.pp_engine=zbv") == [2, 2] == sends("parallelism.pp_engine=dualpipev")


def split_states(actions) -> set[tuple[int, int]]:
    """(awaiting I or B, between I and W) after each compute action of one rank."""
    waiting, pending, seen = 0, 0, set()
    for a in compute_actions(actions):
        kind = a.computation_type.name
        waiting += {"FORWARD": 1, "FULL_BACKWARD": -1, "BACKWARD_INPUT": -1}.get(kind, 0)
        pending += {"BACKWARD_INPUT": 1, "BACKWARD_WEIGHT": -1}.get(kind, 0)
        seen.add((waiting, pending))
    return seen


def test_split_backward_states_match_torch_orders():
    """zbv and dualpipev: for every state (k, w) of torch's order one of
    schedule_model.split_backward_states' pairs (u, v) has v >= w and u + v >= k + w (so it
    bounds a k + b w for any b >= a >= 0), and each pair is reached where it claims exactness
    (zbv with m >= 2 pp - 1, dualpipev always)."""
    from dtensor3d.plan.schedule_model import split_backward_states

    checked = 0
    for p, m in schedule_cases():
        if p.pp_engine not in ("zbv", "dualpipev"):
            continue
        for r, actions in torch_order(p, m).items():
            seen, pairs = split_states(actions), split_backward_states(p, m, r)
            assert all(any(v >= w and u + v >= k + w for u, v in pairs) for k, w in seen), (p.pp_engine, p.pp, m, r)
            if p.pp_engine == "dualpipev" or m >= 2 * p.pp - 1:
                assert set(pairs) <= seen, (p.pp_engine, p.pp, m, r, pairs)
            checked += 1
    assert checked > 50


def test_weight_passes_match_torch_orders():
    """schedule_model.weight_passes: per global stage, the BACKWARD_WEIGHT actions of torch's
    order (zbv, dualpipev; what plan's replay count under full recompute multiplies)."""
    from dtensor3d.plan.schedule_model import weight_passes

    checked = 0
    for p, m in schedule_cases():
        for acts in torch_order(p, m).values():
            for s in {a.stage_index for a in compute_actions(acts)}:
                w = sum(
                    a.computation_type.name == "BACKWARD_WEIGHT" and a.stage_index == s for a in compute_actions(acts)
                )
                assert weight_passes(p, m, s) == w, (p.pp_engine, p.pp, m, s)
                checked += 1
    assert checked > 300


def test_zbv_weight_backward_holds_a_recomputation_per_parameter():
    """pp 2 zbv, recompute full, 8 microbatches; rank 1 holds stages 1 and 2 (one layer each).
    Before its I a microbatch-stage keeps the layer input and the stage output (2 x 8,192 B);
    between I and W also the gradients W reads (74,752 B: the matmul outputs' size; I's
    recomputed layer is gone). torch's order passes (4, 0), (3, 1), (0, 3) (awaiting I,
    between I and W): 3 x 91,136 B. A W recomputes the layer once per parameter tensor (9)
    and keeps the copies until it ends: 9 x (140,288 - 40,960 B its groups free) + 40,960
    (tests/plan/test_plan_accuracy.py measures it); plus the receive buffers (2 per stage and
    microbatch: 32 x 8,192 B). Stage 0's W is a whole backward: one recomputation."""
    from dtensor3d.plan.memory import split_backward_bytes, weight_pass_bytes

    r = recipe("parallelism.pp=2", "parallelism.pp_engine=zbv", "parallelism.recompute=full")
    assert split_backward_bytes(r, range(1)) == 74_752
    assert weight_pass_bytes(r, range(1, 2), first=False) == 9 * (140_288 - 40_960) + 40_960
    assert weight_pass_bytes(r, range(1), first=True) == 0
    row = estimate(r)["stages"][1]
    assert row["pp_stages"] == [1, 2] and row["microbatches_in_flight"] == 4
    assert row["activation_bytes"] == 3 * (16_384 + 74_752) + 9 * (140_288 - 40_960) + 40_960 + 32 * 8_192
    # whole backwards (interleaved) hold nothing past their backward; no recompute: no W copies
    assert split_backward_bytes(recipe("parallelism.pp=2", "parallelism.pp_engine=interleaved_1f1b"), range(1)) == 0
    assert weight_pass_bytes(recipe("parallelism.pp=2", "parallelism.pp_engine=zbv"), range(1, 2), first=False) == 0


@pytest.mark.parametrize("engine", ["1f1b", "zbv"])
def test_tied_embeddings_under_pp_count_a_copy_per_stage_and_their_all_reduce(engine):
    """A tied model at pp 2 x dp 2: the last stage holds its own copy of the matrix (FSDP-
    sharded like the embedding), and the ranks of the first and the last stage all-reduce
    their gradient pieces (counted under pp); under zbv rank 0 holds both and sums locally."""
    tied = ["model.tie_word_embeddings=true", "parallelism.pp=2", "parallelism.dp=2", f"parallelism.pp_engine={engine}"]
    recipe, untied = load_recipe(PARITY, tied), load_recipe(PARITY, tied[1:])
    m, table = recipe.model, param_table(recipe)
    head, embed = table["lm_head.weight"], table["model.embed_tokens.weight"]
    assert (embed["stage"], head["stage"]) == ((0, 1) if engine == "1f1b" else (0, 0))
    assert head["shape"] == embed["shape"] == [m.vocab_size, m.hidden_size]
    assert "lm_head.weight" not in param_table(load_recipe(PARITY, tied[:1]))  # pp 1: one parameter
    piece = 4 * shard_numel(embed["shape"], embed["group"])  # fp32, this rank's FSDP chunk
    for got, base in zip(comm_bytes(recipe, "gloo"), comm_bytes(untied, "gloo")):
        extra = got["pp"]["all_reduce"] - base["pp"]["all_reduce"]
        assert extra == (piece if engine == "1f1b" else 0)
    rows, base_rows = estimate(recipe)["stages"], estimate(untied)["stages"]
    assert [r["params"] for r in rows] == [r["params"] for r in base_rows]  # the head's place is the copy's


def test_sliding_window_layers_count_their_window():
    """FLOPs and kept activations of sliding-window layers, by hand. The parity model (4 layers,
    8 heads of 8: q.k and p.v 2 x 64 wide, 32 tokens) with a window of 6 on layers 0-2, layer 3
    full: attention FLOPs per token 6 x 128 x (3 x 6 + 32) against 6 x 128 x (4 x 32) without
    the window. Under cp 2 (zigzag chunks of 8) a sliding layer keeps its two chunks' keys and
    values and the 5 before each, (16 + 10) tokens x 64 (k and v, 4 kv heads of 8) x 4 B =
    6,656 B, where a full layer keeps the whole gathered sequence, 32 x 64 x 4 = 8,192 B; cp
    gathers only those tails: 10 of this rank's 16 tokens' k and v per sliding layer."""
    from dtensor3d.plan.collectives import cp_gathered_tokens
    from dtensor3d.plan.memory import kept_kv_bytes, layer_activation_bytes
    from dtensor3d.plan.shapes import attended_keys, flops_per_token

    types = "model.layer_types=[sliding_attention, sliding_attention, sliding_attention, full_attention]"
    windowed, full = recipe("model.sliding_window=6", types), recipe()
    assert attended_keys(windowed.model, 32) == 3 * 6 + 32 and attended_keys(full.model, 32) == 4 * 32
    saved = flops_per_token(full.model, 32) - flops_per_token(windowed.model, 32)
    assert saved == 6 * 128 * (4 * 32 - (3 * 6 + 32))
    cp2 = recipe("model.sliding_window=6", types, "parallelism.cp=2")
    assert [kept_kv_bytes(cp2, i) for i in range(4)] == [6_656] * 3 + [8_192]
    assert layer_activation_bytes(cp2, False, 3) - layer_activation_bytes(cp2, False, 0) == 8_192 - 6_656
    assert [cp_gathered_tokens(cp2, i) for i in range(4)] == [10] * 3 + [16]
    # a window wider than a chunk (and no cp at all) keeps and gathers as full attention does
    wide = recipe("model.sliding_window=12", "parallelism.cp=2")
    assert kept_kv_bytes(wide, 0) == 8_192 and cp_gathered_tokens(wide, 0) == 16
    assert kept_kv_bytes(windowed, 0) == kept_kv_bytes(full, 0) == 16 * 64 * 4 * 2
