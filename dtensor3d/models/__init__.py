"""Single-device models (no distributed code here): the Llama-style decoder every family
shares, its mixture-of-experts layer and multi-head latent attention.

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


HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"
MTP_EMBEDDING = "model.mtp_embed_tokens.weight"  # MTP's copy of the embedding on a pipeline's last stage


def stored_name(cfg, name: str) -> str:
    """The name a parameter is initialised, saved and loaded under: a tied model's head
    weight and MTP's copy of the embedding are the embedding's (a pipeline's last stage holds
    its own copy of it)."""
    return EMBEDDING if (name == HEAD and cfg.tie_word_embeddings) or name == MTP_EMBEDDING else name


def materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Allocate (uninitialised) storage for a meta model on `device` and re-tie the head to
    the embedding where they were one parameter (`to_empty` unties them). A rank holding the
    first and the last pipeline stage (zbv, dualpipev) keeps two copies, one per stage
    module (parallel/tied.py sums their gradients)."""
    tied = _is_tied(model)
    model.to_empty(device=device)
    return tie_weights(model) if tied else model


def _is_tied(model: nn.Module) -> bool:
    head, embed = getattr(model, "lm_head", None), _embedding(model)
    return head is not None and embed is not None and head.weight is embed.weight


def _embedding(model: nn.Module) -> nn.Module | None:
    """The embedding the head ties to: embed_tokens, or on a pipeline's last stage MTP's copy
    of it where that copy is the head's parameter (`keep_only`'s `mtp_shares_head`; under a
    V schedule it is a copy of its own: parallel/tied.py)."""
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if embed is None and getattr(inner, "mtp_shares_head", False):
        return inner.mtp_embed_tokens
    return embed


def tie_weights(model: nn.Module) -> nn.Module:
    """Make the head use the embedding's parameter where the config ties them. Anything that
    replaces parameters (tensor parallelism's styles, `to_empty`) unties them; tie again
    right after, and before FSDP, so FSDP manages one parameter, not two."""
    cfg = getattr(model, "cfg", None)
    embed = _embedding(model)
    if cfg is not None and cfg.tie_word_embeddings and model.lm_head is not None and embed is not None:
        model.lm_head.weight = embed.weight  # (MTP's copy on a pipeline's last stage: the head's)
    return model
