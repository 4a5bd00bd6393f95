"""torch.compile of each decoder block, in place (`training.compile: true`).

Build time: `apply_compile`, after tensor/context/expert parallelism and recompute and
before FSDP (parallelize.py's order, as torchtitan's): the compiled region is one block
with its DTensor layouts and checkpoint already in place, and FSDP's hooks stay outside
it. `Module.compile` keeps the module where it is, so parameter names do not change (no
`_orig_mod.` prefix): checkpoints move between compiled and eager runs.

A decoder layer with experts compiles only its attention: its routing (tokens per expert,
`tolist`) has data-dependent shapes that recompile past dynamo's limit at every step, and
dynamo loses `to_local` of the ep-sharded expert weights before grouped_mm.
Tensor parallelism with compile is refused at the door (recipe.validate): compiled blocks
with DTensor tp styles gave gradients unlike eager's.

Compilation itself happens lazily, in the first forward and backward of each block. A
block that fails to compile raises `CompileError` naming it; nothing falls back to eager.
`compile_seconds` is the time torch spent compiling, for the one console line.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

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


def apply_compile(model: nn.Module, backend="inductor") -> nn.Module:
    """Compile every decoder block of this stage in place (one graph per block; blocks of
    the same shape share it). Hitting dynamo's recompile limit raises instead of quietly
    running the block eager (torch's default)."""
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    for index, block in model.model.layers.items():
        # A MoE layer: only its attention (routing has data-dependent shapes that recompile)
        target, name = (block.self_attn, f"model.layers.{index}.self_attn") if _is_moe(block) else (block, None)
        target.compile(backend=backend)
        target._compiled_call_impl = _named_failures(target._compiled_call_impl, name or f"model.layers.{index}")
    return model


def _is_moe(block: nn.Module) -> bool:
    return getattr(block, "block_sparse_moe", None) is not None


def compile_seconds() -> float:
    """Seconds torch has spent compiling in this process (dynamo + inductor, forward and backward)."""
    metrics = torch._dynamo.utils.compilation_time_metrics
    # dynamo's frame compile (with inductor's forward inside it) and inductor's lazy backward compile
    keys = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")
    return sum(sum(metrics.get(key, ())) for key in keys)
