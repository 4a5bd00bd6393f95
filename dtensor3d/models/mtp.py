"""Multi-token prediction (DeepSeek-V3's MTP modules), single-device code.

Depth k (1..D), at position i: h'_i = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)]), then one
decoder block of the family's kind on h', then shared_head.norm, then the main model's head
(shared, not a copy), predicting t_{i+k+1}. The concatenation order (embedding first) is the
one vLLM's `deepseek_mtp.py` and torchtitan's `models/deepseek_v3/mtp.py` load the released
weights with. h^0 follows `model.mtp_hidden`: `pre_norm` is the last decoder layer's output
before the final norm (torchtitan's training code, followed by default), `post_norm` after it
(the hidden states vLLM's and SGLang's MTP read). Depth k > 1 reads depth k-1's output after
its shared_head.norm, as torchtitan chains them.

Parameter names follow the released checkpoint's: model.layers.{N+k-1}.{enorm, hnorm, eh_proj,
shared_head.norm} and the block's own tensors; here they live under `model.mtp.{N+k-1}`.
"""

from __future__ import annotations

import torch
from torch import nn

IGNORE = -100  # cross_entropy's default ignore_index (data.IGNORE)


class SharedHead(nn.Module):
    """DeepSeek's `shared_head`: its norm; the head itself is the main model's lm_head."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm


class MTPMixin:
    """The block's forward with the MTP input and output around it, all inside the module's own
    call (so FSDP's hooks on the block gather enorm, hnorm, eh_proj and shared_head too)."""

    def forward(self, emb: torch.Tensor, h: torch.Tensor, **docs: torch.Tensor) -> torch.Tensor:
        h = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))  # embedding first (vLLM, torchtitan)
        return self.shared_head.norm(super().forward(h, **docs))


_CLASSES: dict[type, type] = {}


def make_mtp_layer(block_cls, norm, cfg, hooks, index: int) -> nn.Module:
    """One MTP module: a decoder block of `block_cls` (the family's kind) with DeepSeek's extra
    enorm, hnorm, eh_proj and shared_head.norm as attributes beside the block's own."""
    cls = _CLASSES.setdefault(block_cls, type(f"MTP{block_cls.__name__}", (MTPMixin, block_cls), {}))
    layer = cls(cfg, hooks, moe=cfg.is_moe_layer(index), index=index)
    layer.enorm, layer.hnorm = norm(cfg, cfg.hidden_size), norm(cfg, cfg.hidden_size)
    layer.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
    layer.shared_head = SharedHead(norm(cfg, cfg.hidden_size))
    return layer


def shift_left(x: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """x[:, i + k] at i, `fill` where i + k falls outside the window."""
    out = torch.full_like(x, fill)
    out[:, : x.shape[1] - k] = x[:, k:]
    return out


def mtp_token_ids(input_ids: torch.Tensor, depth: int) -> torch.Tensor:
    """[b, s, depth]: t_{i+k} at position i in column k-1 (0 past the window, where every depth's
    target is masked). Made from the whole window, before a context-parallel split."""
    return torch.stack([shift_left(input_ids, k, 0) for k in range(1, depth + 1)], dim=-1)


def mtp_embedding(model) -> nn.Module:
    """The input embedding MTP shares: the main model's, or on a pipeline's last stage (which
    has no embed_tokens) its copy of it, `mtp_embed_tokens` (parallel/tied.py sums their gradients)."""
    return model.embed_tokens if model.embed_tokens is not None else model.mtp_embed_tokens


def mtp_forward(model, mtp_ids: torch.Tensor, h0: torch.Tensor, **docs: torch.Tensor) -> list[torch.Tensor]:
    """The MTP depths' hidden states after their shared_head.norm, [b, s, hidden] each.
    `model`: the LlamaModel (embed_tokens, mtp); `mtp_ids` [b, s, D] (mtp_token_ids); `h0` per
    model.mtp_hidden."""
    h, outs, embed = h0, [], mtp_embedding(model)
    for k, layer in enumerate(model.mtp.values(), start=1):
        emb = embed(mtp_ids[..., k - 1].contiguous())  # Emb(t_{i+k}); t past the window: masked targets
        h = layer(emb, h, **docs)
        outs.append(h)
    return outs


def mtp_targets(targets: torch.Tensor, depth: int, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[b, s, 1 + depth]: the main targets, then depth k's (t_{i+k+1} = targets[i+k]), IGNORE where
    i + k leaves the window or (packed documents) crosses into another document. A masked target
    (IGNORE) stays masked at every depth."""
    cols = [targets]
    for k in range(1, depth + 1):
        t = shift_left(targets, k, IGNORE)
        if document_ids is not None:
            same = shift_left(document_ids, k, -1) == document_ids
            t = torch.where(same, t, torch.full_like(t, IGNORE))
        cols.append(t)
    return torch.stack(cols, dim=-1)
