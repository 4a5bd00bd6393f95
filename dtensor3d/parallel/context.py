"""Context parallelism: each sequence split over the cp ranks, attention still exact.

Load balancing for causal attention: the sequence is cut into 2*cp chunks and cp rank i
holds chunks i and 2*cp-1-i, so every rank has one early and one late chunk and the same
number of (query, key) pairs to score. Attention gathers K and V from the cp group (an
autograd function whose backward reduce-scatters their gradients); a query attends to
every key at the same or an earlier global position. RoPE uses the same global positions.
PyTorch's own `context_parallel` has no rule for the CPU attention kernel, so this file
serves CPU and GPU, with two kernels behind one switch, `cp_kernel(device)`:

- "flash" (CPU, where torch has the flash kernel that returns the log-sum-exp): with the
  gathered keys in global order, query chunk c sees chunks 0..c-1 whole and chunk c
  causally. That is two flash calls, merged by their log-sum-exps; the backward runs the
  flash backward on each block with the merged output and log-sum-exp, which gives the
  exact gradients. Saved for backward: q, the gathered k and v, the output and the
  log-sum-exp -- O(S) per rank, never the [S/cp, S] probabilities.
- "masked" (everything else): SDPA with a boolean mask by global position. On CUDA the
  memory-efficient kernel takes the mask; on CPU a mask forces the math kernel, which
  keeps the [b, h, S/cp, S] probabilities for backward.

Packed documents (data.document_masking): each rank's tokens come with their document ids
(the whole window's numbering, sharded like the tokens); they are all-gathered beside K and
V, and a query sees a key only when it is of the same document as well as not later. The
flash kernel then passes each block its mask and leaves out the keys (and whole blocks) no
query of the block sees -- attention work saved where documents are shorter than the
sequence; the masked kernel ANDs the documents into its mask: one switch, equal results
(tests/parallel/test_context.py).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from einops import rearrange
from torch.autograd.function import once_differentiable

from ..config.parallelism import window_tails
from ..models.layers import SequenceLayout, document_mask, sink_attention, visible


def zigzag_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions held by cp rank `rank`: chunks rank and 2*cp-1-rank of 2*cp."""
    chunk = seq_len // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's tokens of a full-sequence tensor."""
    return x.index_select(dim, zigzag_positions(x.shape[dim], cp, rank).to(x.device))


class _GatherSequence(torch.autograd.Function):
    """all-gather along `dim` over `group`; backward sums the gradient over the group and
    keeps this rank's piece (reduce-scatter where the backend has it, else all-reduce)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group, dim = ctx.group, ctx.dim
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        pieces = [p.contiguous() for p in grad.chunk(n, dim=dim)]
        if dist.get_backend(group) == "nccl":
            out = torch.empty_like(pieces[rank])
            dist.reduce_scatter(out, pieces, group=group)
            return out, None, None
        grad = grad.contiguous()
        dist.all_reduce(grad, group=group)  # gloo has no reduce-scatter
        return grad.chunk(n, dim=dim)[rank].contiguous(), None, None


def gather_sequence(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    return _GatherSequence.apply(x, group, dim)


_FLASH_CPU = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")


def cp_kernel(device: torch.device) -> str:
    """The attention kernel cp_attention uses on `device`: "flash" where torch has a flash
    kernel that returns the log-sum-exp (CPU), else "masked"."""
    if device.type == "cpu" and all(hasattr(torch.ops.aten, op) for op in _FLASH_CPU):
        return "flash"
    return "masked"


def _causal_blocks(chunk: int, size: int):
    """(key slice, is_causal) blocks that query chunk `chunk` of `size` tokens attends to,
    keys in global order: every earlier chunk in full, then its own chunk causally."""
    if chunk > 0:
        yield slice(0, chunk * size), False
    yield slice(chunk * size, (chunk + 1) * size), True


def _blocks(chunk: int, size: int, rows: slice, docs: tuple | None):
    """(key slice, is_causal, mask) of query chunk `chunk` (its rows of q: `rows`). `docs`:
    None, or (q_docs [b, s_local] | None, k_docs [b, S] in global order | None, dtype,
    window | None, device). With documents or a sliding window the mask is an additive
    [b, 1, size, keys] one (0 where visible, -inf elsewhere), the keys before the first one
    any query sees are cut off, and a block no query of which sees any key is left out:
    short documents and windows skip most of the earlier chunks' keys."""
    for keys, causal in _causal_blocks(chunk, size):
        if docs is None:
            yield keys, causal, None
            continue
        q_docs, k_docs, dtype, window, device = docs
        q_index = torch.arange(chunk * size, (chunk + 1) * size, device=device)
        k_index = torch.arange(keys.start, keys.stop, device=q_index.device)
        if q_docs is None:
            allowed = visible(q_index, k_index, window)[None, None]
        else:
            allowed = document_mask(q_docs[:, rows], k_docs[:, keys], q_index, k_index, window)
        seen = allowed.flatten(0, 2).any(0).nonzero()  # key columns some query sees
        if len(seen):
            first = int(seen[0])
            allowed = allowed[..., first:]
            mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            yield slice(keys.start + first, keys.stop), False, mask.masked_fill(~allowed, float("-inf"))


def _flash_block(flash, q, k, v, causal: bool, mask: torch.Tensor | None):
    """One flash call; rows that `mask` leaves without a key get log-sum-exp -inf (the
    kernel reports 0 for them), so merging ignores them."""
    o, lse = flash(q, k, v, 0.0, causal, attn_mask=mask)
    if mask is not None:
        lse = lse.masked_fill(~torch.isfinite(mask).any(-1), float("-inf"))
    return o, lse


class _ChunkedCausalAttention(torch.autograd.Function):
    """Causal attention for query chunks `chunks` (each `size` tokens, chunk j of q is the
    sequence's chunk chunks[j]) over keys in global order, by flash blocks merged through
    their log-sum-exps. q: [b, h, n*size, d]; k, v: [b, kv_h, S, d] (kv_h divides h);
    docs: None, or (q_docs [b, n*size], k_docs [b, S] in global order) for packed documents."""

    @staticmethod
    def forward(
        ctx, q, k, v, chunks: tuple[int, ...], docs: tuple | None = None, window: int | None = None, sinks=None
    ):
        flash = getattr(torch.ops.aten, _FLASH_CPU[0])
        b, h, s, d = q.shape
        size = s // len(chunks)
        if docs is not None or window is not None:
            docs = (*(docs or (None, None)), q.dtype, window, q.device)
        out = q.new_empty(b, s, h, d).transpose(1, 2)  # [b, s, h, d] in memory, like SDPA's
        lse = None
        for j, chunk in enumerate(chunks):
            rows = slice(j * size, (j + 1) * size)
            parts = [
                _flash_block(flash, q[:, :, rows], k[:, :, keys], v[:, :, keys], causal, mask)
                for keys, causal, mask in _blocks(chunk, size, rows, docs)
            ]
            if lse is None:
                lse = parts[0][1].new_empty(b, s, h).transpose(1, 2)
            if len(parts) == 1 and sinks is None:
                o, l = parts[0]
            else:  # the sink: one more logit per row, of value zero, in the normaliser once
                extra = [] if sinks is None else [sinks.to(parts[0][1].dtype).view(1, h, 1).expand_as(parts[0][1])]
                l = functools.reduce(torch.logaddexp, [pl for _, pl in parts] + extra)
                o = sum(p.to(l.dtype) * (pl - l).exp().unsqueeze(-1) for p, pl in parts)
            out[:, :, rows] = o
            lse[:, :, rows] = l
        ctx.chunks, ctx.docs, ctx.sinks = chunks, docs, sinks is not None
        ctx.save_for_backward(q, k, v, out, lse, *([] if sinks is None else [sinks]))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        flash_backward = getattr(torch.ops.aten, _FLASH_CPU[1])
        q, k, v, out, lse, *sinks = ctx.saved_tensors
        size = q.shape[2] // len(ctx.chunks)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for j, chunk in enumerate(ctx.chunks):
            rows = slice(j * size, (j + 1) * size)
            for keys, causal, mask in _blocks(chunk, size, rows, ctx.docs):
                # the merged out and lse make each block's probabilities the global ones
                gq, gk, gv = flash_backward(
                    grad[:, :, rows],
                    q[:, :, rows],
                    k[:, :, keys],
                    v[:, :, keys],
                    out[:, :, rows],
                    lse[:, :, rows],
                    0.0,
                    causal,
                    attn_mask=mask,
                )
                dq[:, :, rows] += gq
                dk[:, :, keys] += gk
                dv[:, :, keys] += gv
        return dq, dk, dv, None, None, None, _sink_grad(grad, out, lse, sinks[0]) if sinks else None


def _sink_grad(grad: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks [h]: each row's sink probability exp(sink - lse) times minus the row's
    grad . out (the sink's value is zero; with the sink in `out` and `lse`, flash's backward
    gives q, k and v their exact gradients)."""
    rows = (grad.float() * out.float()).sum(-1)  # [b, h, s]
    p_sink = (sinks.float().view(1, -1, 1) - lse.float()).exp()
    return -(p_sink * rows).sum((0, 2)).to(sinks.dtype)


def _global_order(x: torch.Tensor, cp: int, dim: int = 2) -> torch.Tensor:
    """Gathered chunks (rank 0's two, rank 1's two, ...) put back in sequence order."""
    pieces = x.chunk(2 * cp, dim=dim)
    return torch.cat([pieces[2 * c if c < cp else 2 * (2 * cp - 1 - c) + 1] for c in range(2 * cp)], dim=dim)


def flash_attention(q, k, v, *, q_pos, k_pos, cp: int, rank: int, q_docs=None, k_docs=None, window=None, sinks=None):
    """The "flash" kernel on keys already gathered (cp-rank order); needs the zigzag layout."""
    seq = k.shape[2]
    expected_k = torch.cat([zigzag_positions(seq, cp, r) for r in range(cp)])
    if not (torch.equal(q_pos.cpu(), zigzag_positions(seq, cp, rank)) and torch.equal(k_pos.cpu(), expected_k)):
        raise ValueError(
            "cp_attention(kernel='flash') needs the zigzag layout: q_pos = "
            "zigzag_positions(S, cp, rank), k_pos = every rank's in rank order"
        )
    k, v = _global_order(k, cp), _global_order(v, cp)
    docs = None if q_docs is None else (q_docs, _global_order(k_docs, cp, dim=1))
    width = v.shape[-1]  # the CPU flash kernel needs equal widths: pad multi-head latent attention's values
    v = F.pad(v, (0, q.shape[-1] - width)) if width < q.shape[-1] else v
    return _ChunkedCausalAttention.apply(q, k, v, (rank, 2 * cp - 1 - rank), docs, window, sinks)[..., :width]


def masked_attention(q, k, v, *, q_pos, k_pos, cp: int, rank: int, q_docs=None, k_docs=None, window=None, sinks=None):
    """The "masked" kernel on keys already gathered: SDPA with a mask by global position
    (within the sliding `window` if any; for packed documents, by document id too); with
    `sinks`, the model's own `sink_attention` under the same mask."""
    mask = visible(q_pos, k_pos, window) if q_docs is None else document_mask(q_docs, k_docs, q_pos, k_pos, window)
    if sinks is not None:
        return sink_attention(q, k, v, sinks, mask)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


KERNELS = {"flash": flash_attention, "masked": masked_attention}


def _tails(x: torch.Tensor, t: int, dim: int) -> torch.Tensor:
    """The last t tokens of each of this rank's two chunks along `dim` (2t of them)."""
    c = x.shape[dim] // 2
    return torch.cat([x.narrow(dim, c - t, t), x.narrow(dim, 2 * c - t, t)], dim=dim)


def window_attention(q, k, v, *, group, tails: int, window: int, document_ids=None, sinks=None) -> torch.Tensor:
    """Sliding-window attention when the window fits in a zigzag chunk (`tails` = window - 1 <=
    chunk, config.parallelism.window_tails): a query of chunk g sees only chunk g and the last
    `tails` keys of chunk g - 1, so each rank all-gathers the tails of every chunk (2 x tails
    tokens per rank, not its whole 2 x chunk; the backward sums their gradients as
    `gather_sequence` does) and attends per chunk with SDPA and a mask by global position (and
    document; with `sinks`, the model's `sink_attention` under that mask). q: [b, h, 2c, d]; k, v:
    [b, kv_h, 2c, d]; document_ids: [b, 2c] or None."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    c, rep = q.shape[2] // 2, q.shape[1] // k.shape[1]
    k_tails = _global_order(gather_sequence(_tails(k, tails, 2), group, 2), cp)  # chunk g's tail: piece g
    v_tails = _global_order(gather_sequence(_tails(v, tails, 2), group, 2), cp)
    d_tails = None
    if document_ids is not None:
        parts = [torch.empty_like(_tails(document_ids, tails, 1)) for _ in range(cp)]
        dist.all_gather(parts, _tails(document_ids, tails, 1).contiguous(), group=group)  # ids: no gradient
        d_tails = _global_order(torch.cat(parts, dim=1), cp, dim=1)
    outs = []
    for j, g in enumerate((rank, 2 * cp - 1 - rank)):
        own = slice(j * c, (j + 1) * c)
        keys, values, first = k[:, :, own], v[:, :, own], g * c
        docs = None if document_ids is None else document_ids[:, own]
        if g > 0:  # the tail of chunk g - 1, then chunk g
            piece = slice((g - 1) * tails, g * tails)
            keys, values = torch.cat([k_tails[:, :, piece], keys], 2), torch.cat([v_tails[:, :, piece], values], 2)
            docs = None if docs is None else torch.cat([d_tails[:, piece], docs], 1)
            first -= tails
        q_index = torch.arange(g * c, (g + 1) * c, device=q.device)
        k_index = torch.arange(first, (g + 1) * c, device=q.device)
        if docs is None:
            mask = visible(q_index, k_index, window)
        else:
            mask = document_mask(document_ids[:, own], docs, q_index, k_index, window)
        if sinks is not None:
            outs.append(sink_attention(q[:, :, own], keys, values, sinks, mask))
            continue
        # grouped-query attention without repeating K/V (SDPA takes no GQA with a mask on CUDA):
        # each K/V head's rep query heads stacked along the queries, the mask tiled alike
        qg = rearrange(q[:, :, own], "b (g r) s d -> b g (r s) d", r=rep)
        tiled = mask.repeat(*([1] * (mask.dim() - 2)), rep, 1)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=tiled)
        outs.append(rearrange(out, "b g (r s) d -> b (g r) s d", r=rep))
    return torch.cat(outs, dim=2)


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    kernel: str | None = None,
    document_ids: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact causal attention for this rank's queries over the whole sequence's keys
    (each query over its last `window` positions only, with a sliding window; with `sinks`
    [h], one more logit per head in each row's softmax, once per row whatever the chunks).

    q: [b, h, s_local, d]; k, v: [b, kv_h, s_local, d]; q_pos: [s_local] global positions of
    this rank's tokens; k_pos: [s] global positions of the gathered keys (cp-rank order).
    kernel: "flash" or "masked" (see the module docstring); default cp_kernel(q.device).
    document_ids: [b, s_local] this rank's tokens' documents (packed documents): gathered
    with the keys, and a query sees only keys of its own document."""
    kernel = kernel or cp_kernel(q.device)
    if kernel not in KERNELS:
        raise ValueError(f"cp_attention: kernel {kernel!r}; valid: {', '.join(KERNELS)}")
    if torch.is_autocast_enabled(q.device.type):  # as autocast casts SDPA's inputs (the flash op is on no
        low = torch.get_autocast_dtype(q.device.type)  # autocast list; RoPE leaves q and k in fp32, v is bf16)
        q, k, v = q.to(low), k.to(low), v.to(low)
    cp = dist.get_world_size(group)
    tails = window_tails(window, q.shape[2] * cp, cp)
    if tails and torch.equal(q_pos.cpu(), zigzag_positions(q.shape[2] * cp, cp, dist.get_rank(group))):
        return window_attention(
            q, k, v, group=group, tails=tails, window=window, document_ids=document_ids, sinks=sinks
        )
    k, v = gather_sequence(k, group, 2), gather_sequence(v, group, 2)
    docs = {}
    if document_ids is not None:
        parts = [torch.empty_like(document_ids) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, document_ids.contiguous(), group=group)  # ids: no gradient
        docs = {"q_docs": document_ids, "k_docs": torch.cat(parts, dim=1)}  # k_docs in cp-rank order, like k_pos
    rank = dist.get_rank(group)
    return KERNELS[kernel](q, k, v, q_pos=q_pos, k_pos=k_pos, cp=cp, rank=rank, window=window, sinks=sinks, **docs)


class ContextParallelLayout(SequenceLayout):
    """The model's `SequenceLayout` under context parallelism: this rank holds the zig-zag
    chunks of every sequence, attends over K/V gathered from the cp group, and sums the MoE
    routing statistics over it. Handed to the model at construction (`ModelHooks.sequence`)."""

    def __init__(self, cp_mesh, seq_len: int, device: torch.device):
        cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
        self.group, self.cp = cp_mesh.get_group(), cp
        self.q_pos = zigzag_positions(seq_len, cp, rank).to(device)
        self.k_pos = torch.cat([zigzag_positions(seq_len, cp, r) for r in range(cp)]).to(device)

    def positions(self, n_tokens: int, device: torch.device) -> torch.Tensor:
        if n_tokens != len(self.q_pos):
            raise ValueError(f"context parallelism: {n_tokens} tokens on this rank, the layout has {len(self.q_pos)}")
        return self.q_pos.to(device)

    def attention(self, q, k, v, document_ids=None, window: int | None = None, sinks=None) -> torch.Tensor:
        where = {"group": self.group, "q_pos": self.q_pos, "k_pos": self.k_pos}
        return cp_attention(q, k, v, **where, document_ids=document_ids, window=window, sinks=sinks)

    def sum_over_sequence(self, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        return dist_fn.all_reduce(t, group=self.group), self.cp


def sequence_layout(parallelism, mesh, seq_len: int, device: torch.device) -> SequenceLayout:
    """The layout the model is built with: context-parallel when cp > 1, else the default."""
    if not parallelism.cp_enabled:
        return SequenceLayout()
    return ContextParallelLayout(mesh["cp"], seq_len, device)


def shard_batch(batch: tuple, parallelism, coords: dict[str, int]) -> tuple:
    """Step time: this cp rank's tokens of every full-sequence tensor of the batch (tensors,
    or a dict of them: the documents' position and document ids, which keep the ids the
    whole sequence gave them)."""
    if not parallelism.cp_enabled:
        return batch

    def shard(x):
        if isinstance(x, dict):
            return {key: shard(t) for key, t in x.items()}
        return shard_sequence(x, parallelism.cp, coords["cp"])

    return tuple(shard(x) for x in batch)


def attention_pairs(seq_len: int, cp: int) -> list[int]:
    """Causal (query, key) pairs each cp rank scores: the load balance of the layout."""
    return [int((zigzag_positions(seq_len, cp, r) + 1).sum()) for r in range(cp)]
