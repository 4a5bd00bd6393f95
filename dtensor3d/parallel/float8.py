"""Float8 training through torchao (training.float8): which linears turn into torchao's
`Float8Linear`, the tensor-parallel styles that go with them, and FSDP2's float8 all-gather.

What is converted (torchtitan's rule): every `nn.Linear` inside a decoder block
(`model.layers.*`: attention's projections -- MLA's q_a/q_b/kv_a/kv_b too -- the dense
feed-forward and shared experts) whose in and out features are both divisible by 16
(`torch._scaled_mm`'s requirement). What stays bf16: the embedding, the output head, the
router (not a linear), the routed experts (stacked 3-D matrices for the grouped kernel, which
`convert_to_float8_training` does not take; torchao's MoE float8 training is a CUDA prototype)
and the multi-token prediction blocks.

Precision: `Float8Linear` casts its input and weight to float8 and returns its input's dtype.
Under bf16 autocast on CUDA it casts the input itself; on other devices torchao does not read
autocast, so a pre-hook here casts the input to the autocast dtype (one code path's result on
both). The fp32 master weight is cast straight to float8 -- under FSDP's float8 all-gather too,
so world 1 and dp shard cast the same numbers.

Communication: gloo cannot carry a float8 tensor ("Invalid scalar type", tested in
tests/parallel/test_float8.py), so the float8 input gather of sequence parallelism
(`PrepareFloat8ModuleInput`) is used on CUDA only; CPU gathers the block input in bf16 and
each projection casts it after. FSDP2's float8 all-gather goes through on gloo because a
unit's gathered tensors have mixed dtypes (bf16 norms beside float8 weights), which FSDP2
gathers as one uint8 buffer.

Context parallelism (tensorwise): a cp rank holds part of each sequence, so `scale_over_cp`
makes the converted linears cast their input and output gradient with the amax all-reduced over
cp (one process's scale); torchao's float8 tp styles, which cast over tp only, are then off.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..config.low_precision import float8_all_gather, float8_recipe

BLOCKS = "model.layers."  # the decoder blocks' module paths start so


def float8_config(recipe):
    """torchao's Float8LinearConfig for training.float8 (None when off)."""
    name = float8_recipe(recipe.training)
    if name is None:
        return None
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(name)
    gather = float8_all_gather(recipe.training, recipe.parallelism)
    return Float8LinearConfig(**{**config.__dict__, "enable_fsdp_float8_all_gather": gather})


def convertible(module: nn.Module, fqn: str) -> bool:
    """torchtitan's filter: a decoder block's linear, both dims divisible by 16."""
    if not isinstance(module, nn.Linear) or not fqn.startswith(BLOCKS):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_float8(model: nn.Module, recipe) -> list[str]:
    """Build time, before tp: swap this stage's convertible linears for torchao's Float8Linear
    (on the meta device; parameter names unchanged). Returns the converted module paths."""
    config = float8_config(recipe)
    if config is None:
        return []
    from torchao.float8 import convert_to_float8_training

    names = [n for n, m in model.named_modules() if convertible(m, n)]
    convert_to_float8_training(model, module_filter_fn=convertible, config=config)
    for name in names:
        model.get_submodule(name).register_forward_pre_hook(_autocast_input)
    return names


def _autocast_input(_module, args):
    """Cast the input to the autocast dtype on a device torchao's forward does not look at."""
    x = args[0]
    kind = x.device.type
    if kind != "cuda" and torch.is_autocast_enabled(kind) and x.is_floating_point():
        return (x.to(torch.get_autocast_dtype(kind)), *args[1:])
    return None


def float8_styles(plan: dict, block: nn.Module, device_type: str) -> dict:
    """A tp plan's styles as torchao's float8 ones (tensorwise only, as torchtitan): column and
    row projections that are Float8Linear take Float8ColwiseParallel / Float8RowwiseParallel;
    a block input gather takes PrepareFloat8ModuleInput. What would send float8 over gloo stays
    torch's style off CUDA: the input gather, and under sequence parallelism the row projection
    (its backward gathers the output's float8 gradient)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    out, wire = dict(plan), device_type == "cuda"  # float8 over the wire: NCCL only
    for path, style in plan.items():
        target = block.get_submodule(path)
        gathers_grad = type(style) is RowwiseParallel and not style.output_layouts[0].is_replicate()
        if isinstance(target, Float8Linear) and type(style) in (ColwiseParallel, RowwiseParallel):
            if gathers_grad and not wire:  # sequence parallelism's output grad gather: bf16 on gloo
                continue
            cls = Float8ColwiseParallel if type(style) is ColwiseParallel else Float8RowwiseParallel
            out[path] = cls(
                input_layouts=style.input_layouts[0],
                output_layouts=style.output_layouts[0],
                use_local_output=style.use_local_output,
            )
        elif type(style) is PrepareModuleInput and wire and _all_float8_users(target):
            out[path] = PrepareFloat8ModuleInput(
                input_layouts=style.input_layouts,
                desired_input_layouts=style.desired_input_layouts,
                use_local_output=style.use_local_output,
            )
    return out


def _all_float8_users(module: nn.Module) -> bool:
    """A block (attention, feed-forward) whose input goes only into Float8Linear projections
    (grouped-query attention's q/k/v, the dense MLP's gate/up)."""
    from torchao.float8.float8_linear import Float8Linear

    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    return bool(linears) and all(isinstance(m, Float8Linear) for m in linears) and not hasattr(module, "q_a_proj")


def precompute_scales(model: nn.Module, recipe) -> None:
    """Step time, after the optimizer: the float8 scales of every FSDP-sharded float8 weight in
    one all-reduce (torchao's precompute_float8_dynamic_scale_for_fsdp), for the next gathers."""
    if not float8_all_gather(recipe.training, recipe.parallelism):
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def scale_over_cp(model: nn.Module, recipe, cp_mesh) -> None:
    """Build time, cp > 1 under tensorwise: this stage's Float8Linear modules become
    `ContextParallelFloat8Linear`, whose input and output-gradient casts take the amax over
    the cp group too. A cp rank holds part of each sequence, while one process's tensorwise
    cast scales by the amax of the whole microbatch's tensor: without the all-reduce the scales
    (and so every float8 rounding) differ from one process's (measured: cp 2 grad_norm 7.5e-3
    off one process at step 1). Rowwise needs none: its token-wise casts scale per token, and
    the weight gradient's column scales are powers of 2, which scale the float8 values without
    changing their rounding (bitwise equal on two halves of a tensor with 3x other ranges)."""
    if cp_mesh.size() == 1 or float8_recipe(recipe.training) != "tensorwise":
        return
    from torchao.float8.float8_linear import Float8Linear

    for module in model.modules():
        if isinstance(module, Float8Linear):
            module.__class__ = cp_linear_class()  # same state; FSDP2 swaps classes the same way
            module.cp_mesh = cp_mesh


@functools.cache
def cp_linear_class() -> type:
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
    from torchao.float8.float8_training_tensor import GemmInputRole

    class ContextParallelFloat8Linear(Float8Linear):
        """torchao's Float8Linear with its tensorwise input and output gradient cast here,
        their amax the max over the cp group (and over tp where tp shards the tensor), so that
        torchao's matmul finds them cast and casts only the weight, as one process does. The
        output gradient is cast before the bias (whose gradient stays bf16, as one process's)."""

        cp_mesh = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            kind, c = x.device.type, self.config
            if torch.is_autocast_enabled(kind):  # Float8Linear's own autocast cast (CUDA; _autocast_input elsewhere)
                x = x.to(torch.get_autocast_dtype(kind))
            how = (self.linear_mm_config, c.round_scales_to_power_of_2, self.cp_mesh)
            x = cast_over(x, c.cast_config_input.target_dtype, *how, GemmInputRole.INPUT)
            y = matmul_with_hp_or_float8_args.apply(x, self.weight.t(), self.linear_mm_config, c)
            y = _GradOverCp.apply(y, c.cast_config_grad_output.target_dtype, *how)
            return y if self.bias is None else y + self.bias.to(y.dtype)

    class _GradOverCp(torch.autograd.Function):
        """Forward: y. Backward: y's gradient cast to float8 over the cp group (cast_over);
        torchao's NoopFwToFloat8BwDynamic with the amax reduced."""

        @staticmethod
        def forward(ctx, y, dtype, mm_config, power_of_2, cp_mesh):
            ctx.how = (dtype, mm_config, power_of_2, cp_mesh)
            return y

        @staticmethod
        def backward(ctx, g):
            return cast_over(g, *ctx.how, GemmInputRole.GRAD_OUTPUT), None, None, None, None

    return ContextParallelFloat8Linear


def cast_over(x: torch.Tensor, dtype, mm_config, power_of_2: bool, cp_mesh, role) -> torch.Tensor:
    """x cast to float8 with torchao's tensorwise scale of the tensor the cp ranks (and the tp
    ranks where x is a tp-sharded DTensor) hold together: the local amax, all-reduced (MAX,
    traceable functional collectives), then torchao's amax_to_scale and cast. Already float8: x."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor, all_reduce
    from torch.distributed.tensor import DTensor, Replicate
    from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import amax_to_scale

    if tensor_already_casted_to_fp8(x):
        return x
    spread = isinstance(x, DTensor)
    with torch.no_grad():
        amax = torch.max(torch.abs(x.to_local() if spread else x))
        if spread and any(p.is_shard() for p in x.placements):
            amax = all_reduce(amax, "MAX", x.device_mesh)
        amax = all_reduce(amax, "MAX", cp_mesh)
        amax = amax.wait() if isinstance(amax, AsyncCollectiveTensor) else amax
        scale = amax_to_scale(amax, dtype, power_of_2)
    if spread:
        scale = DTensor.from_local(scale, x.device_mesh, [Replicate()] * x.device_mesh.ndim, run_check=False)
    return hp_tensor_and_scale_to_float8(x, scale, dtype, mm_config, role)


def converted(model: nn.Module) -> list[str]:
    """The module paths of this rank's Float8Linear modules."""
    from torchao.float8.float8_linear import Float8Linear

    return [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]


def describe(names: list[str], recipe) -> str:
    """The run's first line about float8: the recipe, the converted linears by their name in a
    block and the count of blocks, and what stays bf16."""
    by_leaf: dict[str, int] = {}
    for name in names:
        leaf = ".".join(name.split(".")[3:])  # model.layers.<i>.<leaf>
        by_leaf[leaf] = by_leaf.get(leaf, 0) + 1
    parts = ", ".join(f"{leaf} x{n}" for leaf, n in by_leaf.items()) or "none"
    gather = "float8" if float8_all_gather(recipe.training, recipe.parallelism) else "bf16"
    return (
        f"float8: {float8_recipe(recipe.training)}, {len(names)} linears converted ({parts}); bf16: embedding, "
        f"head, routers, routed experts, MTP blocks, linears with a dim not divisible by 16; FSDP gathers {gather}"
    )
