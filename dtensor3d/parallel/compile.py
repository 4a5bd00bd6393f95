"""torch.compile of each decoder block, in place (`training.compile: true`).

Build time: `apply_compile`, after tensor/context/expert parallelism and recompute and
before FSDP (parallelize.py's order, as torchtitan's): the compiled region is one block
with its DTensor layouts (and a selective checkpoint) already in place, and FSDP's hooks stay outside
it. `Module.compile` keeps the module where it is, so parameter names do not change (no
`_orig_mod.` prefix): checkpoints move between compiled and eager runs.

A decoder layer with experts compiles only its attention: its routing (tokens per expert,
`tolist`) has data-dependent shapes that recompile past dynamo's limit at every step, and
dynamo loses `to_local` of the ep-sharded expert weights before grouped_mm.
Under `recompute: full` a dense block compiles its body (`_forward`) and keeps the
checkpoint around it eager (replayed in backward, compiled graph and all), as a layer with
experts does: torch 2.13's trace of a non-reentrant checkpoint whose region holds
scaled_dot_product_attention on tp-sharded heads saves the DeviceMesh as if it were a tensor,
and every rank stops in the first forward ("expected all tensors_saved_with_vc_check to be
Tensors"; found by tests/parallel/test_matrix.py; torch alone: bench/compile_checkpoint_tp.py).
Selective recompute stays inside the compiled block: its policy runs in the trace.
With tensor parallelism a block's DTensor styles (colwise/rowwise, sequence parallel) are
traced inside its graph. What reaches a block from outside is plain, except the first block
of a stage after the embedding: tp's async redistribute makes that an AsyncCollectiveTensor,
whose gradient this torch drops when compiled (`_settled_inputs`, which waits for it first).

Compilation itself happens lazily, in the first forward and backward of each block. A
block that fails to compile raises `CompileError` naming it; nothing falls back to eager.
`compile_seconds` is the time torch spent compiling, for the one console line.
"""

from __future__ import annotations

import functools

import torch
import torch._functorch.config as functorch_config
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from ..errors import EnvError


class CompileError(EnvError):
    """torch.compile could not compile a block (no C++ compiler, an unsupported op, ...)."""


def _named_failures(fn, name: str):
    """fn, raising CompileError naming the module when torch's compiler fails inside it."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        # inductor (or the given backend) failed, or a block kept recompiling past torch's limit
        except (torch._dynamo.exc.BackendCompilerFailed, torch._dynamo.exc.FailOnRecompileLimitHit) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CompileError(
                f"torch.compile of {name} failed: {first[:300]}; set training.compile: false to run eager"
            ) from e

    return call


def _settled_inputs(fn):
    """fn, with every AsyncCollectiveTensor argument waited for outside the compiled region.

    The tp styles redistribute with async_op=True, so the embedding's all-reduce (or
    reduce-scatter) reaches block 0 as an AsyncCollectiveTensor that requires grad over an
    inner tensor that does not. torch 2.13's AOTAutograd unwraps such an input with
    `trigger_wait()` before tracing (pytorch PR #179849) and so traces it as not requiring
    grad: the compiled block returns no gradient for it, and the embedding gets none through
    it (dp2 x tp2: step-1 grad norm 12% low; tp alone: a crash in the embedding's Redistribute
    backward). pytorch PR #191113 fixes that in torch. `clone` waits (the ACT's dispatch) and
    returns a plain tensor with its autograd edge; other arguments pass untouched."""

    def settle(x):
        return x.clone() if isinstance(x, AsyncCollectiveTensor) else x

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return fn(*(settle(a) for a in args), **{k: settle(v) for k, v in kwargs.items()})

    return call


def compile_backend(device_type: str) -> str:
    """The compiler backend per device (pure; the one switch for CPU and CUDA): inductor on
    both (C++/OpenMP kernels on CPU, Triton on CUDA: inductor picks its code generator from
    the tensors' device, not from us). CUDA's extra, tp's micro-pipeline pass, is tp's switch
    (`tensor.tp_overlap`)."""
    del device_type  # the same backend everywhere
    return "inductor"


def compile_targets(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """What is compiled (pure: reads the module tree), as (name, module): every decoder block
    of this stage, or a MoE layer's attention alone (its routing has data-dependent shapes
    that recompile at every step). The MTP modules (models/mtp.py) are blocks too, compiled with
    their enorm, hnorm, eh_proj and shared_head.norm."""
    mtp = getattr(model.model, "mtp", None) or {}
    blocks = [(f"model.layers.{i}", b) for i, b in model.model.layers.items()]
    blocks += [(f"model.mtp.{i}", b) for i, b in mtp.items()]
    return [(f"{name}.self_attn", block.self_attn) if _is_moe(block) else (name, block) for name, block in blocks]


def apply_compile(model: nn.Module, backend="inductor") -> nn.Module:
    """Compile each of `compile_targets` in place (blocks of one shape share their dynamo
    graph: their code object is one and dynamo takes a module's parameters as inputs, so a
    guard on a block's own objects would retrace it per block). Hitting dynamo's recompile limit raises
    instead of quietly running the block eager (torch's default). Inductor rounds to bf16 where
    eager does (`emulate_precision_casts`; its default keeps a fused chain in fp32): a float8
    cast after such a chain moves whole fp8 steps otherwise (OLMo 2 tensorwise, one process:
    step 1's grad_norm 111.03 compiled against 114.88 eager, and 114.88 with the option).

    With more than one rank, AOTAutograd's on-disk cache is off (inductor's own FX graph cache
    stays on): torch 2.13 bakes a process group's name into the compiled graph ('27' for one
    tp group) but leaves it out of AOTAutograd's cache key, so on a warm cache (every rank of
    a host shares /tmp/torchinductor_<user>) a rank of another tp group loads that graph and
    stops at its first forward ("Could not resolve the process group registered under the
    name 27"; found by tests/parallel/test_matrix.py run twice: the deepseek dp 2 x tp 2 x
    pp 2 interleaved, full recompute, compiled run)."""
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    options = {"emulate_precision_casts": True} if backend == "inductor" else None
    if dist.is_initialized() and dist.get_world_size() > 1:
        functorch_config.enable_autograd_cache = False
    for name, target in compile_targets(model):
        if getattr(target, "recompute", "none") == "full":
            # A dense block under full recompute: its body, under an eager checkpoint (module docstring)
            compiled = torch.compile(target._forward, backend=backend, options=options)
            target._forward = _named_failures(_settled_inputs(compiled), name)
            continue
        target.compile(backend=backend, options=options)
        compiled = _settled_inputs(target._compiled_call_impl)
        target._compiled_call_impl = _named_failures(compiled, name)
    return model


def _is_moe(block: nn.Module) -> bool:
    return getattr(block, "block_sparse_moe", None) is not None


def compile_seconds() -> float:
    """Seconds torch has spent compiling in this process (dynamo + inductor, forward and backward)."""
    metrics = torch._dynamo.utils.compilation_time_metrics
    # dynamo's frame compile (with inductor's forward inside it) and inductor's lazy backward compile
    keys = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")
    return sum(sum(metrics.get(key, ())) for key in keys)
