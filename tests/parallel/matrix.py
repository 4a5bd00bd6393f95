"""The combination matrix: every parallelism and training option in one table, the rules that
say which combinations a run can take, and a seeded greedy generator of a pairwise covering
array: runs in which every pair of option values that can run together appears in at least
one run. Written from the README's options and the door's documented refusals, independent
of the code under test (tests/parallel/test_matrix.py checks each generated run passes the
door, then trains it against one process).

Adding an option is one row in OPTIONS (its values and the overrides each means; `model`:
whether it changes the 1-process reference) and, if some combinations cannot run, one Rule.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

LLAMA3_ROPE = (
    "model.rope_scaling={rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, "
    "original_max_position_embeddings: 8}"
)

DOCUMENTS = "<documents>"  # in an override: the prepared directory's path, given to overrides()


@dataclass(frozen=True)
class Option:
    """One option: its values, the overrides each value means, and whether it changes the
    model or the arithmetic (a reference per value) or only how the ranks run it."""

    name: str
    values: dict[str, tuple[str, ...]]
    model: bool = False


def _pp(engine: str) -> tuple[str, ...]:
    virtual = ("parallelism.pp_virtual_stages=2",) if engine == "interleaved_1f1b" else ()
    return ("parallelism.pp=2", f"parallelism.pp_engine={engine}", *virtual)


OPTIONS = (
    # model: the dense recipe as Llama, Qwen3 (per-head q/k norms, head_dim 24 not 64/8, rope_theta
    # 1e6); the mixture-of-experts recipe (tests/recipes/moe_parity.yaml: 8 experts, top-2) as
    # Mixtral or Qwen3-MoE (softmax top-2 not renormalised, experts 64 wide, layer 2 dense, the
    # correction bias updated); DeepSeek-V3-tiny (tests/recipes/deepseek_parity.yaml: latent
    # attention, sigmoid router with the correction bias in groups, one shared expert).
    Option(
        "model",
        {
            "llama": (),
            "qwen3": ("model.family=qwen3", "model.head_dim=24", "model.rope_theta=1000000"),
            "moe": (),
            "qwen3_moe": (
                "model.family=qwen3_moe",
                "model.norm_topk_prob=false",
                "model.moe_intermediate_size=64",
                "model.mlp_only_layers=[2]",
                "model.router_bias_update_rate=0.01",
            ),
            "deepseek_v3": (),
            # OLMo 2: norms after attention and the MLP, q/k norms over the whole projection (tp: the
            # sums of squares all-reduced; no sequence parallelism)
            "olmo2": ("model.family=olmo2", "model.attention_bias=true"),
            # GLM-4.5 on the mixture-of-experts recipe: RoPE on half of each head, q/k/v biases,
            # per-head q/k norms, sigmoid routing with the correction bias in 2 groups, layer 0 dense
            "glm4_moe": (
                "model.family=glm4_moe",
                "model.partial_rotary_factor=0.5",
                "model.attention_bias=true",
                "model.use_qk_norm=true",
                "model.scoring_func=sigmoid",
                "model.n_group=2",
                "model.first_k_dense_replace=1",
            ),
            # SmolLM3: layers 1 and 3 without RoPE (NoPE)
            "smollm3": ("model.family=smollm3", "model.nope_layers=[1, 3]"),
            # gpt-oss on the mixture-of-experts recipe: learned attention sinks (split with the heads
            # under tp, once per row under cp), attention biases, experts and router with biases, the
            # SwiGLU clamped at 0.3 (reached at init), layers 1 and 3 full where the window option slides
            "gpt_oss": (
                "model.family=gpt_oss",
                "model.attention_bias=true",
                "model.swiglu_limit=0.3",
                "model.layer_types=[sliding_attention, full_attention, sliding_attention, full_attention]",
            ),
        },
        model=True,
    ),
    Option("rope", {"plain": (), "llama3_scaled": (LLAMA3_ROPE,)}, model=True),  # past the original 8 positions
    # A sliding window of 6 on 32 tokens: shorter than cp 2's zigzag chunks of 8, so a chunk's
    # queries see the end of the chunk before it (and, with documents, both masks at once).
    Option("window", {"full": (), "6": ("model.sliding_window=6",)}, model=True),
    Option("tied", {"untied": (), "tied": ("model.tie_word_embeddings=true",)}, model=True),
    Option("shared_expert", {"none": (), "32": ("model.shared_expert_intermediate_size=32",)}, model=True),
    Option("moe_layers", {"all": (), "1_3": ("model.moe_layers=[1, 3]",)}, model=True),
    # Packed short documents from a prepared directory (test_matrix.py's `documents` fixture;
    # the run and its reference both read it), each attending only to itself.
    Option(
        "documents",
        {
            "synthetic": (),
            "masked": (
                "data.kind=tokens",
                f"data.path={DOCUMENTS}",
                "model.vocab_size=264",
                "data.document_masking=true",
            ),
        },
        model=True,
    ),
    Option("dtype", {"float32": (), "bfloat16": ("training.dtype=bfloat16",)}, model=True),
    Option("dp", {"1": (), "2": ("parallelism.dp=2",), "4": ("parallelism.dp=4",)}),
    Option(
        "dp_mode",
        {
            "shard": (),
            "replicate": ("parallelism.dp_mode=replicate",),
            "hybrid": ("parallelism.dp_mode=hybrid", "parallelism.dp_shard=2"),
        },
    ),
    Option("cp", {"1": (), "2": ("parallelism.cp=2",)}),
    Option("ep", {"1": (), "2": ("parallelism.ep=2",)}),
    Option(
        "tp",
        {
            "1": (),
            "2_all_reduce": ("parallelism.tp=2", "parallelism.tp_mode=ALL_REDUCE"),
            "2_reduce_scatter": ("parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER"),
        },
    ),
    Option("tp_async", {"off": (), "on": ("parallelism.tp_linear_async_communication=true",)}),
    Option("pp", {"1": (), **{e: _pp(e) for e in ("1f1b", "afab", "interleaved_1f1b", "zbv", "dualpipev")}}),
    Option(
        "recompute",
        {"none": (), "full": ("parallelism.recompute=full",), "selective": ("parallelism.recompute=selective",)},
    ),
    Option("compile", {"eager": (), "compiled": ("training.compile=true",)}),
    # torchao's float8 matmuls on the decoder blocks' linears (parallel/float8.py), bf16 only
    Option(
        "float8",
        {
            "off": (),
            "tensorwise": ("training.float8={recipe: tensorwise}",),
            "rowwise": ("training.float8={recipe: rowwise}",),
        },
        model=True,
    ),
    # Muon on the decoder layers' matrices (training/muon.py), Moonlight's lr adjustment; Newton-Schulz
    # as the run's dtype (muon_ns): fp32 in an fp32 run, torch's bf16 one (the default) in a bf16 run
    Option(
        "optimizer",
        {"adamw": (), "muon": ("optimizer.name=muon", "optimizer.muon_adjust_lr=match_rms_adamw")},
        model=True,
    ),
    # Multi-token prediction (models/mtp.py): one MTP module of the family's block kind; its tokens
    # k ahead cross cp's chunk edges, it lives on pp's last stage with a copy of the embedding
    Option("num_nextn_predict_layers", {"0": (), "1": ("model.num_nextn_predict_layers=1",)}, model=True),
)
BY_NAME = {o.name: o for o in OPTIONS}
EXPERTS = ("moe", "qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss")  # the model values with experts
MAX_WORLD = 8
GLOBAL_BATCH = 8  # the parity recipes' global_batch_size


def ranks(run: dict[str, str]) -> dict[str, int]:
    """The mesh sizes a run asks for."""
    pp = 1 if run["pp"] == "1" else 2
    return {"dp": int(run["dp"]), "cp": int(run["cp"]), "ep": int(run["ep"]), "tp": int(run["tp"][0]), "pp": pp}


def world(run: dict[str, str]) -> int:
    return int(np.prod(list(ranks(run).values())))


def micro_batch(run: dict[str, str]) -> int:
    """Microbatches of 2 (the parity runs' short form); 1 under pp (a schedule needs several)."""
    return 2 if run["pp"] == "1" else 1


def microbatches(run: dict[str, str]) -> float:
    """Microbatches per step on each of the ep x dp batch ranks."""
    r = ranks(run)
    return GLOBAL_BATCH / (micro_batch(run) * r["dp"] * r["ep"])


@dataclass(frozen=True)
class Rule:
    """A combination the matrix does not run; `reads`: the options it looks at (it is checked
    once they all have values); `door`: the trainer refuses it at the door (README), else
    it is the table's own choice (the machine's 8 ranks, a meaningful dp_mode)."""

    why: str
    reads: tuple[str, ...]
    ok: Callable[[dict[str, str]], bool]
    door: bool = True


MOE_ONLY = "{} applies only to a model with experts"
RULES = (
    Rule(f"at most {MAX_WORLD} ranks", ("dp", "cp", "ep", "tp", "pp"), lambda r: world(r) <= MAX_WORLD, door=False),
    Rule(MOE_ONLY.format("ep"), ("ep", "model"), lambda r: r["ep"] == "1" or r["model"] in EXPERTS),
    Rule(
        MOE_ONLY.format("a shared expert"),
        ("shared_expert", "model"),
        lambda r: r["shared_expert"] == "none" or r["model"] in EXPERTS,
    ),
    Rule(
        MOE_ONLY.format("moe_layers"),
        ("moe_layers", "model"),
        lambda r: r["moe_layers"] == "all" or r["model"] in EXPERTS,
    ),
    Rule(
        "sliding windows are for grouped-query attention, not DeepSeek-V3's latent attention",
        ("model", "window"),
        lambda r: r["window"] == "full" or r["model"] != "deepseek_v3",
    ),
    Rule(
        "OLMo 2's norms after attention and the MLP are not sharded by sequence parallelism",
        ("model", "tp"),
        lambda r: r["model"] != "olmo2" or r["tp"] != "2_reduce_scatter",
    ),
    Rule(
        "DeepSeek-V3's one shared expert is n_shared_experts, not shared_expert_intermediate_size too",
        ("shared_expert", "model"),
        lambda r: r["shared_expert"] == "none" or r["model"] != "deepseek_v3",
    ),
    Rule(
        "the overlapped tp path only runs with tp ranks",
        ("tp_async", "tp"),
        lambda r: r["tp_async"] == "off" or r["tp"] != "1",
        door=False,
    ),
    Rule(
        "the overlapped tp path has no multi-head latent attention",
        ("model", "tp_async", "tp"),
        lambda r: not (r["model"] == "deepseek_v3" and r["tp_async"] == "on" and r["tp"] != "1"),
    ),
    Rule(
        "dp_mode replicate / hybrid needs dp ranks",
        ("dp_mode", "dp"),
        lambda r: r["dp_mode"] == "shard" or r["dp"] != "1",
        door=False,
    ),
    Rule(
        "hybrid: dp 4 in FSDP groups of 2",
        ("dp_mode", "dp"),
        lambda r: r["dp_mode"] != "hybrid" or r["dp"] == "4",
        door=False,
    ),
    Rule(
        "the V schedules (zbv, dualpipev) recompute whole layers or none",
        ("pp", "recompute"),
        lambda r: r["pp"] not in ("zbv", "dualpipev") or r["recompute"] != "selective",
    ),
    Rule(
        "experts: no selective recompute under compile (its saved matmul outputs get overwritten)",
        ("model", "recompute", "compile"),
        lambda r: not (r["model"] in EXPERTS and r["recompute"] == "selective" and r["compile"] == "compiled"),
    ),
    Rule(
        "the V schedules' split backward cannot run compiled",
        ("pp", "compile"),
        lambda r: r["pp"] not in ("zbv", "dualpipev") or r["compile"] == "eager",
    ),
    Rule("float8 computes in bf16", ("float8", "dtype"), lambda r: r["float8"] == "off" or r["dtype"] == "bfloat16"),
    Rule(
        "float8 has no overlapped tp path (its chunked matmuls are not torchao's)",
        ("float8", "tp_async", "tp"),
        lambda r: r["float8"] == "off" or r["tp_async"] == "off" or r["tp"] == "1",
    ),
    Rule(
        "a whole number of microbatches per batch rank",
        ("dp", "ep", "pp"),
        lambda r: microbatches(r) == int(microbatches(r)) >= 1,
    ),
    Rule(
        "a schedule needs microbatches: pp of them, 2 x pp for dualpipev",
        ("dp", "ep", "pp"),
        lambda r: r["pp"] == "1" or microbatches(r) >= (4 if r["pp"] == "dualpipev" else 2),
    ),
)


def allowed(run: dict[str, str]) -> bool:
    return all(rule.ok(run) for rule in RULES if all(k in run for k in rule.reads))


# Options no rule reads combine with every allowed combination of the others: the generator
# enumerates only the options some rule reads (CORE) and chooses the free ones (FREE) per run.
FREE = tuple(i for i, o in enumerate(OPTIONS) if not any(o.name in r.reads for r in RULES))
CORE = tuple(i for i in range(len(OPTIONS)) if i not in FREE)
_CORE_PAIRS = tuple(itertools.combinations(range(len(CORE)), 2))  # column pairs of a CORE row


@functools.cache
def feasible() -> np.ndarray:
    """Every combination of the CORE options the rules allow, as value indices (rows, one
    column per CORE option in OPTIONS' order); a rule is checked once, as soon as the last
    option it reads has its value. Computed once (read-only)."""
    at = {OPTIONS[c].name: d for d, c in enumerate(CORE)}
    due = [[r for r in RULES if max(at[k] for k in r.reads) == d] for d in range(len(CORE))]
    rows: list[tuple[int, ...]] = []
    run: dict[str, str] = {}

    def grow(idx: tuple[int, ...]) -> None:
        if len(idx) == len(CORE):
            rows.append(idx)
            return
        option = OPTIONS[CORE[len(idx)]]
        for i, value in enumerate(option.values):
            run[option.name] = value
            if all(rule.ok(run) for rule in due[len(idx)]):
                grow((*idx, i))
        del run[option.name]

    grow(())
    out = np.array(rows, dtype=np.int8)
    out.flags.writeable = False
    return out


def as_run(row) -> dict[str, str]:
    """A full row (a value index per option) as a run; a CORE row gets each free option's first value."""
    if len(row) == len(CORE):
        full = [0] * len(OPTIONS)
        for c, i in zip(CORE, row):
            full[c] = int(i)
        row = full
    return {o.name: list(o.values)[int(i)] for o, i in zip(OPTIONS, row)}


def pairs_of(rows: np.ndarray, columns: tuple[int, ...] | None = None) -> set[tuple[int, int, int, int]]:
    """(option a, value, option b, value) for every pair of columns (a < b) in the rows;
    `columns`: the option each column is (default: every option, in order)."""
    columns = tuple(range(rows.shape[1])) if columns is None else columns
    out = set()
    for a, b in itertools.combinations(range(rows.shape[1]), 2):
        nb = len(OPTIONS[columns[b]].values)
        codes = np.unique(rows[:, a].astype(np.int64) * nb + rows[:, b]).tolist()
        out |= {(columns[a], x // nb, columns[b], x % nb) for x in codes}
    return out


@functools.cache
def feasible_pairs() -> frozenset[tuple[int, int, int, int]]:
    """Every pair of values (option a = x, option b = y, a < b) some allowed combination holds:
    the CORE pairs of the allowed rows, and a free option's every value with every value that
    some allowed row holds."""
    rows = feasible()
    out = pairs_of(rows, CORE)
    held = {c: set(np.unique(rows[:, d]).tolist()) for d, c in enumerate(CORE)}
    held.update({f: set(range(len(OPTIONS[f].values))) for f in FREE})
    for a, b in itertools.combinations(range(len(OPTIONS)), 2):
        if a in FREE or b in FREE:
            out |= {(a, x, b, y) for x in held[a] for y in held[b]}
    return frozenset(out)


def costs(rows: np.ndarray) -> np.ndarray:
    """What each CORE row costs here: its ranks, three times over when compiled (fresh ranks,
    inductor); computed once per distinct mesh and compile value."""
    cols = [d for d, c in enumerate(CORE) if OPTIONS[c].name in ("dp", "cp", "ep", "tp", "pp", "compile")]
    code = np.zeros(len(rows), np.int64)
    for d in cols:  # one mixed-radix number per row from those columns
        code = code * len(OPTIONS[CORE[d]].values) + rows[:, d]
    keys, inverse = np.unique(code, return_inverse=True)
    each = [_cost(int(k), cols) for k in keys]
    return np.array(each)[inverse.ravel()]


def _cost(code: int, cols: list[int]) -> int:
    run = {}
    for d in reversed(cols):
        option = OPTIONS[CORE[d]]
        code, v = divmod(code, len(option.values))
        run[option.name] = list(option.values)[v]
    return world(run) * (3 if run["compile"] == "compiled" else 1)


def _open(uncovered: dict, a: int, x, b: int, y) -> np.ndarray:
    """Whether option a = x with option b = y is still uncovered (x, y: indices or arrays of them)."""
    return uncovered[a, b][x, y] if a < b else uncovered[b, a][y, x]


def _gain(uncovered: dict, cand: np.ndarray, fixed: dict[int, int]) -> np.ndarray:
    """The uncovered pairs each CORE candidate row would cover: its CORE pairs, plus per free
    option those with its fixed value (`fixed`) or else with its best value."""
    gain = sum(_open(uncovered, CORE[i], cand[:, i], CORE[j], cand[:, j]).astype(int) for i, j in _CORE_PAIRS)
    for f in FREE:
        values = [fixed[f]] if f in fixed else range(len(OPTIONS[f].values))
        per = [sum(_open(uncovered, c, cand[:, d], f, v).astype(int) for d, c in enumerate(CORE)) for v in values]
        gain = gain + np.max(per, axis=0)
    return gain


def _complete(uncovered: dict, core_row: np.ndarray, fixed: dict[int, int]) -> list[int]:
    """A full row: the CORE values, then each free option's fixed value or else the value
    covering the most uncovered pairs with the values already in the row (ties: the first)."""
    row: dict[int, int] = {c: int(v) for c, v in zip(CORE, core_row)}
    for f in FREE:
        if f in fixed:
            row[f] = fixed[f]
            continue
        values = range(len(OPTIONS[f].values))
        counts = [sum(bool(_open(uncovered, o, v, f, x)) for o, v in row.items()) for x in values]
        row[f] = int(np.argmax(counts))
    return [row[i] for i in range(len(OPTIONS))]


def covering(seed: int = 0) -> list[dict[str, str]]:
    """A pairwise covering array, greedy and deterministic for a seed: while a pair of values
    is uncovered, take the first such pair, and among the allowed combinations that contain it
    the one covering the most uncovered pairs (ties: the cheapest, then the seeded shuffle);
    the free options' values are chosen last, each covering the most it can."""
    rows = feasible()
    rows = rows[np.random.default_rng(seed).permutation(len(rows))]
    price = costs(rows)
    n, sizes = len(OPTIONS), [len(o.values) for o in OPTIONS]
    uncovered = {(a, b): np.zeros((sizes[a], sizes[b]), bool) for a, b in itertools.combinations(range(n), 2)}
    for a, x, b, y in feasible_pairs():
        uncovered[a, b][x, y] = True
    chosen = []
    while any(u.any() for u in uncovered.values()):
        (a, b), u = next((k, u) for k, u in sorted(uncovered.items()) if u.any())
        x, y = (int(v[0]) for v in np.nonzero(u))
        fixed, mask = {}, np.ones(len(rows), bool)
        for option, value in ((a, x), (b, y)):
            if option in FREE:
                fixed[option] = value
            else:
                mask &= rows[:, CORE.index(option)] == value
        cand, ccost = rows[mask], price[mask]
        best = np.lexsort((ccost, -_gain(uncovered, cand, fixed)))[0]
        row = _complete(uncovered, cand[best], fixed)
        for i, j in uncovered:
            uncovered[i, j][row[i], row[j]] = False
        chosen.append(row)
    return [as_run(r) for r in chosen]


def muon_ns(run: dict[str, str]) -> list[str]:
    """A Muon run's Newton-Schulz dtype: fp32 in an fp32 run, so it is held to 1e-5 -- torch's bf16
    Newton-Schulz turns the ~1e-7 by which a mesh's gradient sums differ into 2e-5 to 1e-3 in the
    grad norm by step 6, fp32 keeps every mesh within 2.1e-7 of one process (measured by hand,
    docs/guides/optimizers.md); torch's bf16 one (the default) in a bf16 run, whose bf16 bars hold
    it, so the default exchange stays run at meshes (measured: OLMo 2 x float8 rowwise x MTP at dp 2
    replicate x pp 2 interleaved passes its bf16 bar with bf16 Newton-Schulz, 14.7% against 15.2%,
    and misses it with fp32, 16.9% against 16.4%: float8's rounding grows either's last bits)."""
    return ["optimizer.muon_ns_dtype=float32"] if run["optimizer"] == "muon" and run["dtype"] == "float32" else []


def overrides(run: dict[str, str], documents: str) -> list[str]:
    """The run's overrides: its options' and the short form (6 steps, microbatches of 2 or 1);
    `documents`: the prepared directory of packed documents."""
    out = ["training.steps=6", f"training.micro_batch_size={micro_batch(run)}"]
    return out + [o.replace(DOCUMENTS, documents) for opt in OPTIONS for o in opt.values[run[opt.name]]] + muon_ns(run)


def reference_overrides(run: dict[str, str], documents: str) -> list[str]:
    """The 1-process run it is compared with: the same model options, no parallelism. The
    microbatch size is the run's for a model with experts (the balance loss is Mixtral's per
    microbatch, so it depends on how many sequences a microbatch holds), and so is a float8
    run's (torchao scales per microbatch: tensorwise by the amax of the microbatch's whole
    tensor, rowwise the weight gradient's columns over the microbatch's tokens; measured on
    OLMo 2 rowwise: one process at microbatch 1 against 2, grad_norm 2.8e-2 off at step 2,
    while pp 2 afab at 1 equals one process at 1 to 2e-7 for 3 steps); a dense model's bf16 or
    fp32 loss is a sum over the global batch's tokens whatever the microbatches, so its
    reference keeps 2."""
    model = [o.replace(DOCUMENTS, documents) for opt in OPTIONS if opt.model for o in opt.values[run[opt.name]]]
    mb = micro_batch(run) if run["model"] in EXPERTS or run["float8"] != "off" else 2
    return ["training.steps=6", f"training.micro_batch_size={mb}", *model, *muon_ns(run)]


def name(run: dict[str, str]) -> str:
    """A run's test id: the options that are not at their first value."""
    parts = [f"{k}={v}" for k, v in run.items() if v != next(iter(BY_NAME[k].values))]
    return "-".join(parts) or "defaults"
