"""plan/collectives.py's byte counts where the width or the number of replays is not the plain
fp32 one: bf16 training (autocast, or FSDP2's bf16 parameters) and full recompute under the V
schedules. Arithmetic only (no ranks): each expected figure is written from the recipe's
shapes, and each equals what real ranks handed to collectives (tests/parallel/comm.py's
counter, `logging.layout: true`, step 2) in the runs named in each docstring."""

from helpers import PARITY

from dtensor3d.config.load import load_recipe
from dtensor3d.plan.collectives import comm_bytes

# The parity model: 4 layers, hidden 64, sequence 32 (16 rows per tp rank under sequence
# parallelism), global batch 8 of microbatches of 1.
ROWS, HALF, HIDDEN = 32, 16, 64


def tp_of(*overrides, rank=0):
    return comm_bytes(load_recipe(PARITY, list(overrides)), backend="gloo")[rank]


def test_fsdp_bf16_puts_every_activation_on_the_wire_in_bf16():
    """FSDP2 gathers bf16 parameters and training runs without autocast, so the residual
    stream, the norms' outputs and every activation gradient are bf16: dp2 x tp2 sequence
    parallel (4 microbatches) all-gathers per microbatch 4 layers x 2 blocks x (forward input
    + backward gradient) + the embedding's and the head's 16 x 64 rows at 2 bytes, and
    reduce-scatters as many 32-row tensors; loss_parallel's three sums and the norms'
    gradients stay fp32. Under autocast (dp 1: no FSDP) the residual side stays fp32 (a
    matmul output alone is bf16). Measured on both runs, every rank, exact."""
    sp = ["parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER", "training.dtype=bfloat16"]
    fsdp = tp_of(*sp, "parallelism.dp=2")["tp"]
    assert fsdp["all_gather"] == 4 * (4 * 2 * 2 + 2) * HALF * HIDDEN * 2 == 147_456
    assert fsdp["reduce_scatter"] == 4 * (4 * 2 * 2 + 2) * ROWS * HIDDEN * 2 == 294_912
    assert fsdp["all_reduce"] == 4 * 3 * ROWS * 4 + 9 * HIDDEN * 4 == 3_840
    autocast = tp_of(*sp)["tp"]  # 8 microbatches; forward gathers fp32, backward gathers bf16
    assert autocast["all_gather"] == 8 * ((4 * 2 + 2) * HALF * HIDDEN * 4 + 4 * 2 * HALF * HIDDEN * 2) == 458_752
    assert autocast["reduce_scatter"] == 8 * (4 * 2 * 2 + (4 * 2 + 2) * 4) * ROWS * HIDDEN == 917_504


def test_fsdp_bf16_pipeline_sends_bf16():
    """dp2 x pp2 1f1b bf16 (FSDP2): each rank sends one 32 x 64 tensor per microbatch (4) in
    bf16; pp2 bf16 at dp 1 (autocast) sends the fp32 residual stream (8 microbatches).
    Measured, exact."""
    pp = ["parallelism.pp=2", "training.dtype=bfloat16"]
    assert [c["pp"]["send_recv"] for c in comm_bytes(load_recipe(PARITY, [*pp, "parallelism.dp=2"]), "gloo")] == [
        4 * ROWS * HIDDEN * 2
    ] * 2
    assert [c["pp"]["send_recv"] for c in comm_bytes(load_recipe(PARITY, pp), "gloo")] == [8 * ROWS * HIDDEN * 4] * 2


def test_v_schedules_replay_a_layer_per_weight_group_under_full_recompute():
    """tp2 sequence parallel x pp2, recompute full, 8 microbatches, fp32. A layer's forward
    gathers 2 x 16 x 64 x 4 = 8,192 B, its backward as much, and each replay of it as much
    (the feed-forward's last reduce-scatter is not replayed). Every backward replays a layer
    once; a weight backward W on a stage other than the first once per weight group (9 in a
    parity layer: 2 norms, q, k, v, o, gate, up, down). zbv splits all 8 backwards of a stage,
    dualpipev one per stage at pp 2 (rank 0's first stage: 2, but stage 0 runs its backward
    whole). Rank 0 holds stages 0 and 3, rank 1 stages 1 and 2, each L / 4 layers; the
    embedding and the head gather 4,096 B each on rank 0. Measured at 4 and 8 layers, both
    schedules, every rank, exact; so were Qwen2 (q/k/v biases) under ALL_REDUCE and cp2 x pp2
    zbv (k and v of 16 tokens, 4,096 B, per gather)."""
    unit, ends = 2 * HALF * HIDDEN * 4, 2 * HALF * HIDDEN * 4 // 2
    run = ["parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER", "parallelism.pp=2", "parallelism.recompute=full"]
    for layers in (4, 8):
        per_stage = layers // 4
        for engine, w_passes in (("zbv", 8), ("dualpipev", 1)):
            over = [*run, f"parallelism.pp_engine={engine}", f"model.num_hidden_layers={layers}"]
            got = [c["tp"]["all_gather"] for c in comm_bytes(load_recipe(PARITY, over), "gloo")]
            base = 2 * per_stage * 3 * 8 * unit
            assert got == [
                base + 8 * 2 * ends + per_stage * 9 * w_passes * unit,  # stage 3's layers only
                base + 2 * per_stage * 9 * w_passes * unit,
            ], (engine, layers)
    # Qwen2's q/k/v biases add no weight group (a bias's gradient reads nothing saved): its
    # ALL_REDUCE zbv run measured the same tp bytes as the bias-free layer's
    ar = [run[0], "parallelism.tp_mode=ALL_REDUCE", *run[2:], "parallelism.pp_engine=zbv"]
    qwen2, llama = (comm_bytes(load_recipe(PARITY, ar + fam), "gloo") for fam in (["model.family=qwen2"], []))
    assert [c["tp"] for c in qwen2] == [c["tp"] for c in llama]
    cp = ["parallelism.cp=2", "parallelism.pp=2", "parallelism.pp_engine=zbv", "parallelism.recompute=full"]
    kv = ROWS // 2 * 64 * 4  # 16 local tokens x (k 32 + v 32 wide) fp32
    assert [c["cp"]["all_gather"] for c in comm_bytes(load_recipe(PARITY, cp), "gloo")] == [
        (2 * 8 + 2 * 8 + 9 * 8) * kv,  # stage 0: forward and one replay per microbatch
        2 * (2 * 8 + 9 * 8) * kv,
    ]


def test_moe_all_reduce_gathers_in_the_residual_dtype():
    """An MoE layer under tp ALL_REDUCE routes 1/tp of the tokens and all-gathers its output
    (forward) and its input's gradient (backward) in x's dtype: fp32 under bf16 autocast
    (the combined expert output is summed into an fp32 tensor), bf16 under FSDP2's bf16
    parameters. tp2 x pp2 1f1b, 8 microbatches, 2 MoE layers per rank, 16 rows x 64; not
    replayed by recompute (the layer's last collective). Measured (autocast, tied, selective
    recompute: the matrix's run), every rank, exact, with its routing sums (17 scores) in bf16:
    CPU autocast runs the router's linear and softmax in bf16."""
    from helpers import MOE

    run = ["parallelism.tp=2", "parallelism.tp_mode=ALL_REDUCE", "parallelism.pp=2", "training.dtype=bfloat16"]
    autocast = comm_bytes(load_recipe(MOE, [*run, "parallelism.recompute=selective"]), "gloo")
    assert [c["tp"]["all_gather"] for c in autocast] == [8 * 2 * 2 * HALF * HIDDEN * 4] * 2
    fsdp = comm_bytes(load_recipe(MOE, [*run, "parallelism.dp=2"]), "gloo")
    assert [c["tp"]["all_gather"] for c in fsdp] == [4 * 2 * 2 * HALF * HIDDEN * 2] * 2
    from dtensor3d.plan.params import sizes

    # the routing sums' width: bf16 where autocast leaves the router's scores bf16 (measured on CPU)
    width = lambda *o: sizes(load_recipe(MOE, ["training.dtype=bfloat16", *o])).router  # noqa: E731
    assert (width(), width("parallelism.dp=2"), width("training.device=cuda")) == (2, 4, 4)
    assert width("training.device=cuda", "model.scoring_func=sigmoid") == 2


ASYNC = ["parallelism.tp=2", "parallelism.tp_linear_async_communication=true"]
SP = "parallelism.tp_mode=REDUCE_SCATTER"


def test_async_column_groups_reduce_the_input_gradient_at_the_compute_width():
    """The async path's column group reduces its matmul's output, the input gradient g @ w,
    which bf16 autocast (on in the trainer's backward too) computes in bf16; DTensor's sync
    path reduces the gradient of the fp32 input. tp2 bf16 at dp 1 (autocast), 8
    microbatches: ALL_REDUCE all-reduces per microbatch 4 layers x 2 groups x (forward row
    output + backward input gradient) 32 x 64 at 2 B, the embedding's and the head's fp32
    rows and loss_parallel's three sums; sequence parallelism reduce-scatters 4 x 2 x 2
    bf16 and the embedding's and head's fp32 32-row tensors. Measured on both runs, both
    ranks, exact; so was the matrix's dp2 replicate x tp2 ALL_REDUCE x pp2 afab run (rank
    0: 2 layers and the embedding, 4 microbatches: 163,840 B)."""
    bf16 = [*ASYNC, "training.dtype=bfloat16"]
    got = tp_of(*bf16, "parallelism.tp_mode=ALL_REDUCE")["tp"]["all_reduce"]
    assert got == 8 * (4 * 2 * 2 * ROWS * HIDDEN * 2 + 2 * ROWS * HIDDEN * 4 + 3 * ROWS * 4) == 658_432
    assert (
        tp_of(*bf16, SP)["tp"]["reduce_scatter"]
        == 8 * (4 * 2 * 2 * ROWS * HIDDEN * 2 + 2 * ROWS * HIDDEN * 4)
        == 655_360
    )
    afab = [*bf16, "parallelism.tp_mode=ALL_REDUCE", "parallelism.dp=2", "parallelism.dp_mode=replicate"]
    rank0 = tp_of(*afab, "parallelism.pp=2", "parallelism.pp_engine=afab")["tp"]["all_reduce"]
    assert rank0 == 4 * (2 * 2 * 2 * ROWS * HIDDEN * 2 + ROWS * HIDDEN * 4) == 163_840


def test_recompute_replays_the_async_row_reduce_scatter():
    """The async row linear (o, down under sequence parallelism) is one autograd Function,
    whose saved tensors torch packs when it returns -- after its reduce-scatter -- so full
    and selective recompute both run a dense layer's last reduce-scatter again (the sync
    path's recompute stops before it). tp2 sequence parallel fp32, 8 microbatches: per
    microbatch 4 layers x 2 x (forward, backward, replay) + the embedding's and the head's
    32 x 64 x 4 B. Measured at both recompute levels, both ranks, exact; so were the
    matrix's qwen3_moe hybrid dp4 x tp2 selective run (2 dense layers, 1 microbatch of 64
    rows in bf16: 163,840 B) and qwen3 bf16 cp2 x tp2 x pp2 1f1b full."""
    for level in ("full", "selective"):
        got = tp_of(*ASYNC, SP, f"parallelism.recompute={level}")["tp"]
        assert got["reduce_scatter"] == 8 * (4 * 2 * 3 + 2) * ROWS * HIDDEN * 4 == 1_703_936, level
        assert got["all_gather"] == 8 * (4 * 2 * 3 + 2) * HALF * HIDDEN * 4 == 851_968, level


def test_v_schedule_weight_passes_of_the_async_functions():
    """Under zbv the async column group is one parameter group (q/k/v's weights, gate/up's,
    meet the activations at one node: 6 groups in a parity layer, 9 in the sync path); its
    weight backward W sends nothing (no input gradient: async_tp._input_grad_wanted), while a
    row linear's W under sequence parallelism gathers its output gradient again (its weight
    gradient reads it). tp2 x pp2 zbv, fp32, 8 microbatches, one layer per stage; rank 0
    holds stages 0 (its backward whole: no W) and 3 (and the embedding, the head and
    loss_parallel's sums), rank 1 stages 1 and 2. Measured, every rank, exact: ALL_REDUCE
    without recompute, and sequence parallelism under full recompute (per W: the weight
    pass's replay of the layer for each of its 6 groups). Before the trainer skipped the
    input gradient, each W all-reduced it again: 789,504 and 786,432 B measured."""
    full = ROWS * HIDDEN * 4
    ar = [
        c["tp"]["all_reduce"]
        for c in comm_bytes(load_recipe(PARITY, [*ASYNC, "parallelism.pp=2", "parallelism.pp_engine=zbv"]), "gloo")
    ]
    layer = 2 * 2 * full  # forward row outputs and backward input gradients of one layer and microbatch
    assert ar == [8 * (2 * layer + 2 * full + 3 * ROWS * 4), 8 * 2 * layer] == [658_432, 524_288]
    over = [*ASYNC, SP, "parallelism.pp=2", "parallelism.pp_engine=zbv", "parallelism.recompute=full"]
    sp = [c["tp"] for c in comm_bytes(load_recipe(PARITY, over), "gloo")]
    # one layer and microbatch: forward 2, backward 2, replay 2 of each kind (half the rows
    # gathered); per W of a layer: 6 groups' replays and the 2 row gradients' gathers
    layer, w_rs, w_ag = 6 * full, 6 * 2 * full, (6 * 2 + 2) * full // 2
    assert (
        [c["reduce_scatter"] for c in sp]
        == [
            8 * (2 * layer + 2 * full) + 8 * w_rs,
            8 * 2 * layer + 2 * 8 * w_rs,
        ]
        == [1_703_936, 2_359_296]
    )
    assert (
        [c["all_gather"] for c in sp]
        == [
            8 * (2 * layer + 2 * full) // 2 + 8 * w_ag,
            8 * 2 * layer // 2 + 2 * 8 * w_ag,
        ]
        == [917_504, 1_310_720]
    )
    # cp's k/v gathers are replayed per weight group too: cp2 x tp2 ALL_REDUCE x pp2 zbv full,
    # 16 local tokens x (k + v: 2 local kv heads of 8 each) fp32 per gather; measured on all 8
    # ranks, exact (tp and cp), as was the matrix's qwen3_moe cp2 x tp2 async zbv run
    kv = HALF * 32 * 4
    cp = ["parallelism.cp=2", "parallelism.tp_mode=ALL_REDUCE", "parallelism.pp=2", "parallelism.pp_engine=zbv"]
    got = comm_bytes(load_recipe(PARITY, [*ASYNC, *cp, "parallelism.recompute=full"]), "gloo")
    assert [c["cp"]["all_gather"] for c in got] == [(2 * 8 + 2 * 8 + 6 * 8) * kv, 2 * (2 * 8 + 6 * 8) * kv]


def test_fsdp_sums_the_norm_gradients_in_bf16_with_one_microbatch():
    """FSDP2 redistributes a norm's tp-partial gradient in the gradient's dtype: bf16 with
    one microbatch per step, fp32 once it has accumulated two (its reduce dtype). dp2 x tp2
    sequence parallel bf16, microbatches of 4 rows (1 per step): loss_parallel's three sums
    over 128 tokens in fp32 and the 9 norms' 64-element gradients in bf16. Measured, every
    rank, exact (4 microbatches: 9 x 256 B, test_fsdp_bf16_puts_every_activation_on_the_wire_in_bf16);
    so was the matrix's qwen3_moe hybrid run (1 microbatch: its per-head q/k norms in bf16 too)."""
    one = tp_of(SP, "parallelism.tp=2", "training.dtype=bfloat16", "parallelism.dp=2", "training.micro_batch_size=4")[
        "tp"
    ]
    assert one["all_reduce"] == 3 * 4 * ROWS * 4 + 9 * HIDDEN * 2 == 2_688


def test_async_moe_layer_under_dualpipev_full_recompute():
    """An MoE layer's async attention merges q/k/v into one weight group (11 of 13: 2 norms,
    the group, o, the router, 3 expert tensors, 3 shared-expert linears), whose weight
    backward sends nothing. The matrix's MoE ep2 x tp2 ALL_REDUCE x pp2 dualpipev full run
    (4 microbatches; rank 0: dense layer 0 on stage 0, MoE layer 3 on stage 3, one W there)
    measured 827,420 B of tp all-reduces on rank 0, exact (835,612 before the W stopped
    all-reducing the input gradient again). Against the sync path: 2 fewer replays of layer 3
    (its attention output's all-reduce and its 17 routing sums); both all-reduce one input
    gradient per q/k/v (gate/up) group and microbatch (the sync plan's PrepareModuleInput)."""
    from helpers import MOE

    run = [*ASYNC[:1], "parallelism.ep=2", "parallelism.tp_mode=ALL_REDUCE", "parallelism.pp=2"]
    run += ["parallelism.pp_engine=dualpipev", "parallelism.recompute=full", "model.moe_layers=[1, 3]"]
    run += ["model.shared_expert_intermediate_size=32", "model.tie_word_embeddings=true"]
    sync, got = (
        comm_bytes(load_recipe(MOE, [*run, f"parallelism.tp_linear_async_communication={on}"]), "gloo")
        for on in ("false", "true")
    )
    full, stats = ROWS * HIDDEN * 4, 17 * 4
    assert got[0]["tp"]["all_reduce"] == 827_420
    assert got[0]["tp"]["all_reduce"] - sync[0]["tp"]["all_reduce"] == -2 * (full + stats)


def test_cuda_micro_pipeline_tp_is_counted_as_the_sync_plan():
    """On CUDA under training.compile with sequence parallelism the async key takes
    inductor's micro-pipeline rewrite of the sync plan (parallel/tensor.py tp_overlap), not
    the Functions the tests above measured: the estimate is the sync plan's (not measured:
    no GPU here), and the chunked Functions' model stays on for ALL_REDUCE there."""
    cuda = ["training.device=cuda", "training.compile=true", "parallelism.recompute=full", "training.dtype=bfloat16"]
    over = ["parallelism.tp=2", "parallelism.pp=2", *cuda]
    for mode, same in ((SP, True), ("parallelism.tp_mode=ALL_REDUCE", False)):
        sync, chunked = (
            comm_bytes(load_recipe(PARITY, [*over, mode, f"parallelism.tp_linear_async_communication={on}"]), "nccl")
            for on in ("false", "true")
        )
        assert ([c["tp"] for c in sync] == [c["tp"] for c in chunked]) == same, mode
