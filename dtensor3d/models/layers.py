"""Layers shared by the models, and `ModelHooks`: the one typed place where a parallelism
changes what happens inside a single-device model.

Nothing here is distributed code. A parallelism that needs to change the model's
inside (context parallelism: which tokens this rank holds and how attention reaches the
others; expert parallelism: where the experts run) hands the model a `ModelHooks` at
construction; the defaults are the single-device behaviour.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)


def mean_square(xf: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [..., 1]: the mean of squares over the last dim (what RMSNorm divides by)."""
    return xf.pow(2).mean(-1, keepdim=True)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False, mean_sq: Callable = mean_square
) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 and scaled in x's dtype; `offset`: scaled
    by 1 + weight in fp32 (Gemma's x·(1+w)), then cast. `mean_sq`: how the mean of squares
    is taken (a caller holding a slice of the normalised dim passes one over every slice)."""
    xf = x.float()
    xf = xf * torch.rsqrt(mean_sq(xf) + eps)
    if offset:
        return (xf * (1.0 + weight.float())).type_as(x)
    return weight * xf.type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset)


def visible(q_index: torch.Tensor, k_index: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[sq, sk] True where a query may see a key: not later and, with a sliding `window`, one of
    the query's last `window` positions (i - window < j <= i, as transformers masks it)."""
    seen = k_index[None, :] <= q_index[:, None]
    return seen if window is None else seen & (k_index[None, :] > q_index[:, None] - window)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """q: [b, h, s, d]; k, v: [b, kv_h, s, d] -> [b, h, s, d]. Grouped-query attention by
    the kernel itself (no repeated K/V kept for backward); a `window` shorter than the
    sequence masks the keys before it (SDPA with a boolean mask)."""
    gqa = q.shape[1] != k.shape[1]
    if window is None or window >= q.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    index = torch.arange(q.shape[2], device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible(index, index, window), enable_gqa=gqa)


def document_mask(
    q_docs: torch.Tensor, k_docs: torch.Tensor, q_index: torch.Tensor, k_index: torch.Tensor, window: int | None = None
):
    """[b, 1, sq, sk] True where a query may see a key: the same document (document ids
    [b, sq], [b, sk]) and `visible` by position (window indices [sq], [sk])."""
    return (visible(q_index, k_index, window) & (q_docs[:, :, None] == k_docs[:, None, :]))[:, None]


def document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """Causal attention within documents: q: [b, h, s, d]; k, v: [b, kv_h, s, d];
    document_ids: [b, s] (packed documents; data.document_masking). SDPA with a boolean mask
    on every device: on CPU torch runs its flash kernel with the mask, on CUDA the
    memory-efficient one. K/V heads are repeated for grouped-query attention first: SDPA's
    enable_gqa with a mask would fall back to the math kernel on CUDA ([b, h, s, s] kept)."""
    index = torch.arange(q.shape[2], device=q.device)
    mask = document_mask(document_ids, document_ids, index, index, window)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Attention with a learned sink per head (gpt-oss): one more logit, `sinks` [h], in each
    row's softmax, whose value is zero -- it only takes its share of the probability. q: [b, h,
    sq, d]; k, v: [b, kv_h, sk, d]; mask: bool, broadcast to [b, h, sq, sk] (True: visible).
    The scores as transformers' eager kernel computes them ([b, h, sq, sk] kept), the softmax in
    fp32 as the fused kernels do (bf16 inputs: rounded once, to v's dtype, after it)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5  # [b, h, sq, sk]
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return probs.to(v.dtype) @ v


def sequence_mask(q: torch.Tensor, document_ids: torch.Tensor | None, window: int | None) -> torch.Tensor:
    """The bool mask of one device's whole sequences: causal, within the `window`, within documents."""
    index = torch.arange(q.shape[2], device=q.device)
    if document_ids is None:
        return visible(index, index, window)
    return document_mask(document_ids, document_ids, index, index, window)


class KVCache:
    """Keys and values of the tokens already seen, per attention layer, for generation
    (datasets-free; generate.py and the harness are its users).

    Pass one KVCache to `LlamaForCausalLM.forward(ids, cache)`: each Attention appends its
    new keys/values (`update`), and the model then advances `length` by the new tokens, so
    the next call only runs the tokens after them. A layer with a sliding window keeps only
    its last `window` - 1 keys between calls (all a later query can see): a rolling cache.

    A batch of prompts of different lengths is left-padded: `pad` [b] holds each row's count
    of padding tokens in front. Row r's token at index j then has position j - pad[r] (RoPE),
    and no real query sees a padding key (a padding query sees itself alone: no empty softmax
    row). `spare`: extra keys a rolling cache keeps, for callers that append tokens and then
    `drop_last` them (a sequence-parallel forward padded to a length tp divides)."""

    def __init__(self, pad: torch.Tensor | None = None, spare: int = 0):
        self.length = 0  # tokens cached so far (the position of the next token)
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pad, self.spare = pad, spare

    def update(
        self, layer: nn.Module, k: torch.Tensor, v: torch.Tensor, window: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Append k, v [b, kv_h, new, d] to `layer`'s; return the keys and values the new
        queries may need [b, kv_h, kept + new, d] and the position of the first of them."""
        old = self.layers.get(id(layer))
        if old is not None:
            k, v = torch.cat([old[0], k], dim=2), torch.cat([old[1], v], dim=2)
        start = self.length - (0 if old is None else old[0].shape[2])
        keep = k.shape[2] if window is None else min(k.shape[2], window - 1 + self.spare)
        self.layers[id(layer)] = (k[:, :, k.shape[2] - keep :], v[:, :, v.shape[2] - keep :])
        return k, v, start

    def positions(self, new: int, device: torch.device) -> torch.Tensor:
        """RoPE positions of the `new` tokens after the cached ones: [new], or [b, new] left-padded."""
        index = torch.arange(self.length, self.length + new, device=device)
        return index if self.pad is None else (index[None, :] - self.pad.to(device)[:, None]).clamp(min=0)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (finished generations leave the batch)."""
        self.layers = {key: (k[rows], v[rows]) for key, (k, v) in self.layers.items()}
        self.pad = None if self.pad is None else self.pad[rows]

    def drop_last(self, n: int) -> None:
        """Forget the last n tokens of every layer (and of the length)."""
        if n:
            self.layers = {key: (k[:, :, :-n], v[:, :, :-n]) for key, (k, v) in self.layers.items()}
            self.length -= n


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int = 0,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    pad: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [b, h, new, d] for the last `new` positions of k, v: [b, kv_h, total, d], whose
    first is at position `start`; query i sees the keys `visible` to it (and the `sinks`);
    `pad` [b]: each row's left padding (KVCache), whose keys only a padding query sees (itself)."""
    new, total = q.shape[2], k.shape[2]
    if new == total and start == 0 and sinks is None and pad is None:
        return causal_attention(q, k, v, window)
    query_pos = torch.arange(start + total - new, start + total, device=q.device)
    key_pos = torch.arange(start, start + total, device=q.device)
    mask = visible(query_pos, key_pos, window)  # [new, total]
    if pad is not None:  # [b, 1, new, total]
        real = key_pos[None, :] >= pad.to(q.device)[:, None]  # [b, total]
        mask = (mask[None] & (real[:, None, :] | (key_pos[None, :] == query_pos[:, None])[None]))[:, None]
    if sinks is not None:
        return sink_attention(q, k, v, sinks, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


class SequenceLayout:
    """Which tokens of each sequence this rank holds and how attention reaches the others.

    This default is the single-device one: every token, in order. Context parallelism
    (parallel/context.py) supplies a subclass for its zig-zag chunks."""

    def positions(self, n_tokens: int, device: torch.device) -> torch.Tensor:
        """Global positions of the n_tokens this rank holds (for RoPE)."""
        return torch.arange(n_tokens, device=device)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Exact causal attention of this rank's queries over the whole sequence's keys;
        with `document_ids` [b, s_local] (this rank's tokens), within their documents; with
        a sliding `window`, over each query's last `window` positions only; with `sinks` [h]
        (this rank's heads), one more logit per head in each row's softmax (`sink_attention`)."""
        if sinks is not None:
            return sink_attention(q, k, v, sinks, sequence_mask(q, document_ids, window))
        if document_ids is None:
            return causal_attention(q, k, v, window)
        return document_attention(q, k, v, document_ids, window)

    def sum_over_sequence(self, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(t summed over the ranks that hold parts of the same sequences, their count).
        The sum is differentiable (its backward sums too)."""
        return t, 1


class TokenShare:
    """Which of a microbatch's tokens this rank routes through the experts. The default is
    the single-device one: all of them. Tensor parallelism (parallel/expert.py) supplies a
    subclass that gives each tp rank a disjoint share."""

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, h] -> this rank's tokens [T_r, h]."""
        return x

    def gather(self, y: torch.Tensor, total: int) -> torch.Tensor:
        """This rank's outputs [T_r, h] -> every token's [total, h]."""
        return y

    def sum_over_shares(self, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(t summed over the ranks sharing the tokens, their count); differentiable."""
        return t, 1


# dispatch(experts, tokens sorted by expert [T, h], tokens per expert [E]) -> expert outputs [T, h]
ExpertDispatch = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelHooks:
    """What a parallelism changes inside a model, given at construction.

    sequence:         context parallelism's token layout and attention (default: all tokens here)
    expert_dispatch:  expert parallelism's route to the experts (None: all experts here)
    tokens:           tensor parallelism's share of the tokens each rank routes (default: all)
    aux_loss_scale:   gradient scale of the MoE balance loss (coef / microbatches per step;
                      0: no balance loss, as in a forward-only model)
    recompute:        "none", "full" (keep only each decoder layer's input for backward) or
                      "selective" (keep its matmul outputs too: `recompute_context`)
    vocab_layout:     (bias [padded vocab], logits) -> the bias laid out as the logits are
                      (tensor parallelism: sharded on the vocabulary); default: as it is
    """

    sequence: SequenceLayout = field(default_factory=SequenceLayout)
    expert_dispatch: ExpertDispatch | None = None
    tokens: TokenShare = field(default_factory=TokenShare)
    aux_loss_scale: float = 0.0
    recompute: str = "none"
    vocab_layout: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lambda bias, logits: bias


def mask_padded_vocab(logits: torch.Tensor, vocab: int, hooks: ModelHooks) -> torch.Tensor:
    """Logits [..., padded vocab] with the padding's (ids >= vocab: model.pad_vocab_to_multiple_of)
    at -inf: no probability in the loss's softmax or in generation, and no gradient."""
    padded = logits.shape[-1]
    if padded == vocab:
        return logits
    bias = torch.zeros(padded, dtype=logits.dtype, device=logits.device)
    bias[vocab:] = float("-inf")
    return logits + hooks.vocab_layout(bias, logits)


# Ops whose outputs selective recompute keeps: the matmuls (and attention, a pair of them);
# everything else in a decoder layer (norms, RoPE, SiLU, products, adds) runs again in backward.
MATMUL_OPS = frozenset(
    op
    for name in (
        "mm",
        "addmm",
        "bmm",
        "_grouped_mm",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
    )
    if (op := getattr(torch.ops.aten, name, None)) is not None
)


PROFILER_OPS = (
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
)


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    packet = getattr(op, "overloadpacket", op)  # aten.mm.default -> aten.mm
    return CheckpointPolicy.MUST_SAVE if packet in MATMUL_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def recompute_context(mode: str):
    """torch.utils.checkpoint's context_fn for a recompute mode: full keeps nothing inside the
    layer (torch's default); selective keeps the outputs of MATMUL_OPS."""
    if mode == "selective":
        # A profiler label inside the layer (FSDP2's, around an expert unit's gather) runs
        # again in the recomputation as often as the FSDP state asks, not as in the forward:
        # selective checkpointing must pass those ops through as it does detach (found by the
        # matrix: deepseek_v3 cp2 x ep2 x afab pp2, "invocation index 2 ... not found in storage").
        SAC_IGNORED_OPS.update(PROFILER_OPS)
        return partial(create_selective_checkpoint_contexts, _keep_matmuls)
    return noop_context_fn


class MLP(nn.Module):
    def __init__(self, cfg, intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        bias = getattr(cfg, "mlp_bias", False)
        self.gelu = getattr(cfg, "hidden_act", "silu") == "gelu_pytorch_tanh"  # GeGLU (Gemma 3), else SwiGLU
        self.gate_proj = nn.Linear(cfg.hidden_size, inter, bias=bias)
        self.up_proj = nn.Linear(cfg.hidden_size, inter, bias=bias)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = F.gelu(self.gate_proj(x), approximate="tanh") if self.gelu else F.silu(self.gate_proj(x))
        return self.down_proj(gate * self.up_proj(x))


def init_std(name: str) -> float | None:
    """Initial std of a parameter by name; None means ones (norm weights), 0.0 zeros (biases)."""
    if name.endswith("norm.weight"):
        return None
    return 0.0 if name.endswith((".bias", "_bias", "e_score_correction_bias")) else 0.02
