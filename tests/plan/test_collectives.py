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
