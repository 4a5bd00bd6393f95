"""Single-device models (no distributed code here): Llama and its mixture-of-experts variant.

`llama.py` is the whole dense model, `moe.py` the expert layer and router, `layers.py` the
shared pieces (attention, RoPE, RMSNorm, the KV cache) and `ModelHooks`, through which the
parallel dimensions reach inside at construction. May import config only; no process
groups or collectives (a test checks).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .llama import LlamaForCausalLM


def build_on_meta(cfg, **kwargs) -> LlamaForCausalLM:
    """The whole model on the meta device: shapes only, no memory. Parallelise it, then
    `materialize` it. The modules' own random init is skipped (meta tensors hold no values;
    init_weights fills the real ones): on meta it runs torch's Python references, whose
    first call imports dynamo and DTensor (seconds a one-token generate process would pay)."""
    with torch.device("meta"), _no_module_init():
        return LlamaForCausalLM(cfg, **kwargs)


@contextlib.contextmanager
def _no_module_init():
    """nn.Linear / nn.Embedding constructors without their reset_parameters."""
    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}
    try:
        for cls in saved:
            cls.reset_parameters = lambda self: None
        yield
    finally:
        for cls, reset in saved.items():
            cls.reset_parameters = reset


def materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Allocate (uninitialised) storage for a meta model on `device` and re-tie the head to
    the embedding where the config ties them (`to_empty` unties them)."""
    model.to_empty(device=device)
    return tie_weights(model)


def tie_weights(model: nn.Module) -> nn.Module:
    """Make the head use the embedding's parameter where the config ties them. Anything that
    replaces parameters (tensor parallelism's styles, `to_empty`) unties them; tie again
    right after, and before FSDP, so FSDP manages one parameter, not two."""
    cfg = getattr(model, "cfg", None)
    if (
        cfg is not None
        and cfg.tie_word_embeddings
        and model.lm_head is not None
        and model.model.embed_tokens is not None
    ):
        model.lm_head.weight = model.model.embed_tokens.weight
    return model
