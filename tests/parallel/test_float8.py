"""training.float8 (parallel/float8.py) in one process: the fact the CPU path rests on (gloo has
no float8), which linears are converted (the module filter against plan's torch-free rule), the
tp styles per device, plan's float8 all-gather bytes, and the outside reference: torchao alone
on transformers' model of the same Hugging Face directory."""

import tempfile
from types import SimpleNamespace as NS

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("torchao")

from helpers import DEEPSEEK, PARITY, TINY_HF_LLAMA  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402
from torchao.float8.float8_tensor_parallel import (  # noqa: E402
    Float8ColwiseParallel,
    Float8RowwiseParallel,
    PrepareFloat8ModuleInput,
)

from dtensor3d.config.load import load_recipe  # noqa: E402
from dtensor3d.config.low_precision import float8_weight  # noqa: E402
from dtensor3d.models import build_on_meta  # noqa: E402
from dtensor3d.parallel.float8 import apply_float8, float8_styles  # noqa: E402
from dtensor3d.parallel.tensor import tp_plan  # noqa: E402
from dtensor3d.plan.collectives import comm_bytes  # noqa: E402
from dtensor3d.plan.shapes import param_shapes  # noqa: E402


def _f8(recipe: str, fsdp: bool = False):
    """The two recipe sections apply_float8 reads."""
    return NS(training=NS(float8={"recipe": recipe}), parallelism=NS(fsdp_enabled=fsdp))


def test_gloo_cannot_carry_a_float8_tensor():
    """Why the CPU path gathers in bf16 (or, under FSDP2, as one uint8 buffer): gloo refuses float8."""
    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
    try:
        x = torch.ones(4).to(torch.float8_e4m3fn)
        with pytest.raises(RuntimeError, match="Invalid scalar type"):
            dist.all_gather([torch.empty_like(x)], x)
        y = x.view(torch.uint8)
        dist.all_gather([out := torch.empty_like(y)], y)
        assert torch.equal(out, y)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("path", [PARITY, DEEPSEEK])
def test_converted_linears_are_the_block_linears_divisible_by_16(path):
    cfg = load_recipe(path, []).model
    model = build_on_meta(cfg)
    names = apply_float8(model, _f8("tensorwise"))
    want = {n.removesuffix(".weight") for n, s in param_shapes(cfg).items() if float8_weight(n, tuple(s))}
    assert set(names) == want and want
    assert {n for n, m in model.named_modules() if isinstance(m, Float8Linear)} == want
    assert not any(n.startswith(("lm_head", "model.embed_tokens")) or ".gate" == n[-5:] for n in names)
    if cfg.mla:  # q_a (24 rows), q_b (24 in), kv_a (28 rows), kv_b (20 in) stay bf16; layer 0 is dense
        assert {n.split(".", 3)[3] for n in names} == {
            "self_attn.o_proj",
            *("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
            "block_sparse_moe.shared_expert.gate_proj",
            "block_sparse_moe.shared_expert.up_proj",
            "block_sparse_moe.shared_expert.down_proj",
        }


def test_float8_tp_styles_per_device():
    """tensorwise: the projections take torchao's float8 styles; what would send float8 over the
    wire (the block input gather, sequence parallelism's row projection) only on CUDA."""
    model = build_on_meta(load_recipe(PARITY, []).model)
    apply_float8(model, _f8("tensorwise"))
    block = model.model.layers["0"]
    layer = {k: v for k, v in tp_plan(True)[1].items() if _has(block, k)}
    cpu, cuda = float8_styles(layer, block, "cpu"), float8_styles(layer, block, "cuda")
    assert type(cpu["self_attn.q_proj"]) is Float8ColwiseParallel is type(cuda["mlp.up_proj"])
    assert type(cpu["self_attn.o_proj"]) is RowwiseParallel and type(cuda["self_attn.o_proj"]) is Float8RowwiseParallel
    assert type(cpu["mlp"]) is PrepareModuleInput and type(cuda["mlp"]) is PrepareFloat8ModuleInput
    replicated = {k: v for k, v in tp_plan(False)[1].items() if _has(block, k)}
    assert type(float8_styles(replicated, block, "cpu")["mlp.down_proj"]) is Float8RowwiseParallel
    assert type(layer["self_attn.q_proj"]) is ColwiseParallel  # the plan itself is unchanged


def _has(block, path: str) -> bool:
    try:
        block.get_submodule(path)
        return True
    except AttributeError:
        return False


def test_plan_gathers_float8_weights_in_one_byte():
    """dp 2 shard: tensorwise's all-gather is bf16's less one byte per float8 weight element (half
    of bf16's for them), plus the scales' amax all-reduce; rowwise gathers bf16."""
    base = ["training.dtype=bfloat16", "parallelism.dp=2", "parallelism.fsdp_reshard_after_forward=default"]
    bf16, tw, rw = (
        comm_bytes(load_recipe(PARITY, base + extra))[0]["dp"]
        for extra in ([], ["training.float8={recipe: tensorwise}"], ["training.float8={recipe: rowwise}"])
    )
    cfg = load_recipe(PARITY, []).model
    fp8 = [s for n, s in param_shapes(cfg).items() if float8_weight(n, tuple(s))]
    gathers = bf16["all_gather"] // (2 * 90400)  # bf16: 2 bytes of each of the 90400 parameters a rank holds
    assert bf16["all_gather"] == gathers * 2 * 90400 and gathers >= 1
    assert bf16["all_gather"] - tw["all_gather"] == gathers * sum(s[0] * s[1] for s in fp8) // 2  # 1 byte, not 2
    assert tw.get("all_reduce", 0) - bf16.get("all_reduce", 0) == 4 * len(fp8)
    assert rw == bf16


# tp 2 on the parity model in bf16, 8 microbatches: the tp all-reduce bytes rank 0 hands to collectives
# in step 2 (parallel/comm.py's count, as check_comm reads it), measured 2026-12-05 with each call's
# torchao call site; bf16 alone: 5,376 (REDUCE_SCATTER: loss_parallel and the norms' gradients) and
# 920,576 (ALL_REDUCE: also the row outputs and column input gradients).
MEASURED_TP_ALL_REDUCE = {
    ("rowwise", "REDUCE_SCATTER", "none"): 177_408,
    ("rowwise", "ALL_REDUCE", "none"): 1_092_608,
    ("rowwise", "ALL_REDUCE", "full"): 1_272_832,
    ("rowwise", "REDUCE_SCATTER", "selective"): 226_560,
    ("tensorwise", "REDUCE_SCATTER", "none"): 11_264,
    ("tensorwise", "ALL_REDUCE", "none"): 925_952,
    ("tensorwise", "REDUCE_SCATTER", "full"): 13_568,
}


@pytest.mark.parametrize("case", list(MEASURED_TP_ALL_REDUCE), ids="-".join)
def test_plan_counts_the_float8_scale_all_reduces_under_tp(case):
    """torchao reduces each amax a tp shard cuts as float64 (plan/float8_comm.py): rowwise
    (8 x 21,504 B a step here: tokens and in / out values per linear) and tensorwise (one value
    per cast); plan's tp all-reduce bytes equal the measured step's, with full and selective recompute
    too (the forward's casts run again). The combination matrix checks the same against every
    float8 x tp run it trains (check_comm)."""
    recipe, mode, recompute = case
    given = ["training.dtype=bfloat16", f"training.float8={{recipe: {recipe}}}", "parallelism.tp=2"]
    given += [f"parallelism.tp_mode={mode}", f"parallelism.recompute={recompute}"]
    assert comm_bytes(load_recipe(PARITY, given), "gloo")[0]["tp"]["all_reduce"] == MEASURED_TP_ALL_REDUCE[case]


def _cuda_autocast_input(_module, args):
    """What torchao's Float8Linear.forward does under CUDA autocast (casts its input to the
    autocast dtype); on CPU it reads no autocast, so the reference gets this pre-hook."""
    return (args[0].to(torch.bfloat16), *args[1:])


def test_conversion_matches_torchao_alone_on_transformers(tmp_path):
    """The outside reference: our model read from a Hugging Face directory (as init_from_hf reads
    it) and converted by parallel/float8.py, against transformers' model of that directory
    converted by plain convert_to_float8_training (the head left out, torchtitan's filter): the
    same step-1 loss, bitwise, in both schemes dtensor3d runs bf16 in -- bf16 weights (FSDP2's
    MixedPrecisionPolicy) and one process's fp32 weights under bf16 autocast, with torchao's
    CUDA autocast input cast on the reference (CPU torchao reads no autocast). The bf16 runs are
    bitwise equal too, so float8's difference is within twice bf16's (both 0). Plain CPU torchao
    under autocast (fp32 input straight to float8, fp32 output) differs by 4.6e-5 tensorwise and
    1.8e-4 rowwise (relative): another scheme, not the one dtensor3d or CUDA runs."""
    transformers = pytest.importorskip("transformers")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from dtensor3d.checkpoint import load_model

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_HF_LLAMA)).save_pretrained(tmp_path)
    tokens = torch.randint(0, 256, (4, 33))
    for dtype in (torch.bfloat16, torch.float32):  # bf16 weights; fp32 weights under autocast
        losses = {}
        for recipe in (None, "tensorwise", "rowwise"):
            ours = load_model(tmp_path).train().to(dtype)
            theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=dtype).train()
            if recipe:
                apply_float8(ours, _f8(recipe))
                config = Float8LinearConfig.from_recipe_name(recipe)
                convert_to_float8_training(theirs, config=config, module_filter_fn=lambda m, fqn: fqn != "lm_head")
                for m in theirs.modules():
                    if isinstance(m, Float8Linear) and dtype == torch.float32:
                        m.register_forward_pre_hook(_cuda_autocast_input)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.float32):
                pair = [ours(tokens[:, :-1]), theirs(tokens[:, :-1]).logits]
            losses[recipe] = [F.cross_entropy(lg.float().flatten(0, 1), tokens[:, 1:].flatten()).item() for lg in pair]
        assert losses[None][0] == losses[None][1], (dtype, losses)
        for recipe in ("tensorwise", "rowwise"):
            assert losses[recipe][0] == losses[recipe][1], (dtype, losses)
            assert losses[recipe][0] != losses[None][0]  # float8 did change the numbers


def test_float8_linears_keep_no_weight_copy_and_plan_counts_it():
    """What a converted linear keeps for backward (torchao's matmul_with_hp_or_float8_args saves
    its high-precision input and weight; tensorwise and rowwise alike): under one process's bf16
    autocast, nn.Linear keeps a bf16 copy of its fp32 weight, Float8Linear the fp32 weight itself
    (no copy; backward casts it to float8 again), both the bf16 input. Over the parity model's
    forward the kept bytes differ by exactly the bf16 copies of the converted block weights:
    plan's weight_copy_bytes difference."""
    from dtensor3d.models import materialize
    from dtensor3d.parallel.shards import init_weights
    from dtensor3d.plan.activations import kept_bytes
    from dtensor3d.plan.memory import weight_copy_bytes

    ids, kept = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0)), {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bytes, not speed: 2.7 s at a load of 26 (two threads: 14 s)
    try:
        for recipe in (None, "tensorwise", "rowwise"):
            model = build_on_meta(load_recipe(PARITY, []).model)
            if recipe:
                apply_float8(model, _f8(recipe))
            materialize(model, "cpu")
            init_weights(model, 7)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, kept[recipe] = kept_bytes(lambda: model(ids[:, :-1]), model)  # noqa: B023
    finally:
        torch.set_num_threads(threads)
    plans = {r: load_recipe(PARITY, ["training.dtype=bfloat16"] + ([f"training.float8={{recipe: {r}}}"] if r else []))
             for r in kept}  # fmt: skip
    for recipe in ("tensorwise", "rowwise"):
        saving = weight_copy_bytes(plans[None], 0) - weight_copy_bytes(plans[recipe], 0)
        assert saving == 2 * 4 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64)  # 4 layers' q, o, k, v, gate, up, down
        assert kept[None] - kept[recipe] == saving, kept


def test_cp_linear_casts_as_torchao_does_when_its_group_holds_the_whole_tensor():
    """Under cp tensorwise (parallel/float8.scale_over_cp) a converted linear casts its input and
    output gradient itself, the amax all-reduced over cp, and torchao's matmul casts only the
    weight. Where the group holds the whole tensor (one rank here) that is torchao's computation:
    output, input, weight and bias gradients bitwise Float8Linear's. Across ranks (2-rank check
    by hand: halves of a batch with 3x and 5x other ranges) the output and the input gradient
    equal one process's bitwise, where torchao's own casts are 4.9e-2 and 8.4e-2 off; the
    combination matrix trains cp 2 tensorwise against one process."""
    import copy

    from helpers import one_rank_group
    from torch.distributed.device_mesh import init_device_mesh
    from torchao.float8 import Float8LinearConfig

    from dtensor3d.parallel.float8 import cp_linear_class, scale_over_cp

    torch.manual_seed(0)
    x, g = torch.randn(2, 32, 64, dtype=torch.bfloat16), torch.randn(2, 32, 128, dtype=torch.bfloat16)
    x[:, :16] *= 3
    one = torch.nn.Sequential(Float8Linear.from_float(torch.nn.Linear(64, 128), Float8LinearConfig()))
    cp = copy.deepcopy(one)
    with one_rank_group():
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
        scale_over_cp(cp, NS(training=NS(float8={"recipe": "tensorwise"})), mesh)  # cp 1: nothing to do
        assert type(cp[0]) is Float8Linear
        cp[0].__class__, cp[0].cp_mesh = cp_linear_class(), mesh
        outs = []
        for model in (one, cp):
            xs = x.clone().requires_grad_()
            y = model(xs)
            y.backward(g)
            outs.append([y, xs.grad, model[0].weight.grad, model[0].bias.grad])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


# Measured by hand (logging.layout's step-2 collective bytes, rank 0, parity model, microbatch 1,
# float8 tensorwise): (cp's all-reduce, tp's all-reduce); cp 2's cp group is also dp x cp's.
MEASURED_CP = {"cp2": (131_968, 0), "cp2-tp2": (66_432, 297_008), "dp2-tp2": (0, 297_456)}


@pytest.mark.parametrize("mesh", list(MEASURED_CP))
def test_plan_counts_the_float8_amax_all_reduces_under_cp(mesh):
    """Under cp tensorwise each converted linear all-reduces one bf16 amax over cp forward and one
    backward (28 linears x 8 microbatches x 2 x 2 B = 896 B a step), over tp first where tp
    shards the tensor; FSDP gathers the weights cast, so
    torchao's weight casts reduce nothing and its per-step scale precompute one fp32 value per
    weight over tp (so at dp 2 x tp 2 too). plan's cp and tp all-reduce bytes equal the measured step's."""
    given = ["training.micro_batch_size=1", "training.dtype=bfloat16", f"parallelism.{mesh[:2]}=2"]
    given += ["parallelism.tp=2"] * ("tp2" in mesh)
    f8, bf16 = (comm_bytes(load_recipe(PARITY, g), "gloo")[0] for g in (given + [_TENSORWISE], given))
    assert (f8["cp"].get("all_reduce", 0), f8["tp"].get("all_reduce", 0)) == MEASURED_CP[mesh]
    assert f8["cp"].get("all_reduce", 0) - bf16["cp"].get("all_reduce", 0) == 896 * mesh.startswith("cp")


_TENSORWISE = "training.float8={recipe: tensorwise}"
