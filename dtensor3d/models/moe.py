"""Mixture-of-experts feed-forward (Mixtral's names): a softmax router picks the top
`num_experts_per_tok` experts of `num_local_experts` per token, with weights normalised to
sum to one; every token is processed (dropless: no capacity, nothing dropped). An optional
shared expert sees every token. A switch-style load-balancing loss is added through the
gradient (`AddAuxLoss`), so the forward output is unchanged and any pipeline stage can hold
MoE layers.

Single-device code. What a parallelism changes comes in through `ModelHooks`
(models/layers.py): expert parallelism's `expert_dispatch` (the route of the sorted tokens
to the experts), tensor parallelism's `tokens` (each tp rank routes a disjoint share) and
context parallelism's `sequence.sum_over_sequence` (the routing statistics of a sequence
spread over several ranks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import MLP, ModelHooks


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (grouped_mm needs one)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def expert_matmul(x: torch.Tensor, w: torch.Tensor, counts: list[int], grouped: bool) -> torch.Tensor:
    """Rows of x, sorted by expert with `counts` rows each, times their expert's w [E, in, out]."""
    if grouped:
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(x, w, offs=offs))
    return (
        torch.cat([xi @ wi for xi, wi in zip(x.split(counts), w.unbind(0))]) if counts else x.new_zeros(0, w.shape[-1])
    )


# The dtype each backend's grouped kernel is used for (CUDA: bf16, as on Hopper-class GPUs;
# CPU: fp32, seen here). Any other device or dtype takes the loop over the experts.
GROUPED_MM_DTYPES = {"cuda": torch.bfloat16, "cpu": torch.float32}


def use_grouped_mm(device_type: str, dtype: torch.dtype, row_bytes: tuple[int, ...]) -> bool:
    """The experts' switch (pure): one grouped matmul where the installed torch has one, the
    device's kernel takes the dtype and every row of the weights is 16-byte aligned as it
    requires; else the loop over the experts. `row_bytes`: the bytes of a row of each weight dim."""
    aligned = all(n % 16 == 0 for n in row_bytes)
    return hasattr(torch, "_grouped_mm") and aligned and dtype == GROUPED_MM_DTYPES.get(device_type)


def grouped_mm_available(x: torch.Tensor, w: torch.Tensor) -> bool:
    """`use_grouped_mm` for these tensors (the same dtype for both)."""
    rows = tuple(n * x.element_size() for n in w.shape[1:])
    return x.dtype == w.dtype and use_grouped_mm(x.device.type, x.dtype, rows)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's expert activation, as transformers' GptOssExperts computes it: the gate clamped
    above and the up projection on both sides at `limit`, then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class Experts(nn.Module):
    """E SwiGLU experts stacked: w1 (gate) and w3 (up) [E, hidden, inter], w2 (down) [E, inter, hidden];
    with `bias` (gpt-oss) their biases w1_bias, w3_bias [E, inter] and w2_bias [E, hidden]; with
    `limit` (gpt-oss's swiglu_limit) the clamped SwiGLU of gain `alpha` (`clamped_swiglu`)."""

    def __init__(
        self, num_experts: int, hidden: int, inter: int, bias: bool = False, limit: float | None = None, alpha=1.702
    ):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.w2 = nn.Parameter(torch.empty(num_experts, inter, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, inter))
        if bias:
            self.w1_bias = nn.Parameter(torch.empty(num_experts, inter))
            self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden))
            self.w3_bias = nn.Parameter(torch.empty(num_experts, inter))
        self.limit, self.alpha = limit, alpha
        self.grouped_mm: bool | None = None  # None: decide from device and dtype

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w2, self.w3))
        grouped = self.grouped_mm if self.grouped_mm is not None else grouped_mm_available(x, w1)
        gate, up = expert_matmul(x, w1, counts, grouped), expert_matmul(x, w3, counts, grouped)
        rows = None
        if hasattr(self, "w1_bias"):  # each row's expert's bias
            rows = torch.repeat_interleave(
                torch.arange(len(counts), device=x.device), torch.tensor(counts).to(x.device)
            )
            b1, b2, b3 = (
                b.to_local() if hasattr(b, "to_local") else b for b in (self.w1_bias, self.w2_bias, self.w3_bias)
            )
            gate, up = gate + b1[rows], up + b3[rows]
        h = F.silu(gate) * up if self.limit is None else clamped_swiglu(gate, up, self.limit, self.alpha)
        out = expert_matmul(h, w2, counts, grouped)
        return out if rows is None else out + b2[rows]


def local_dispatch(experts: Experts, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """All experts are here: run the sorted tokens through them."""
    return experts(x_sorted, counts.tolist())


class AddAuxLoss(torch.autograd.Function):
    """Return x unchanged; in backward, also send gradient `scale` into aux_loss."""

    @staticmethod
    def forward(ctx, x, aux_loss, scale: float):
        ctx.scale = scale
        ctx.save_for_backward(aux_loss)
        return x

    @staticmethod
    def backward(ctx, g):
        (aux_loss,) = ctx.saved_tensors
        return g, torch.full_like(aux_loss, ctx.scale), None


class Router(nn.Module):
    """Scores every expert per token and picks top_k, as transformers' routers compute it.

    softmax (Mixtral, Qwen3-MoE) or sigmoid (DeepSeek-V3) scores, of logits with a `bias` where the
    family has one (gpt-oss, whose softmax over the top-k logits is the softmax renormalised over
    the top k: norm_topk_prob); with `e_score_correction_bias`
    (DeepSeek-V3; aux-loss-free balancing) the bias is added for the choice only; with n_group > 1
    a token may only pick experts in its topk_group best groups (a group's score: the sum of its
    top 2); weights are the chosen scores, renormalised (norm_topk_prob) and scaled
    (routed_scaling_factor). The bias is a parameter without gradient: model state that init,
    checkpoints, resharding and export see by name; the trainer moves it (training/balance.py)."""

    def __init__(self, cfg):
        super().__init__()
        self.top_k, self.sigmoid = cfg.num_experts_per_tok, cfg.scoring_func == "sigmoid"
        self.n_group, self.topk_group, self.norm = cfg.n_group, cfg.topk_group, cfg.norm_topk_prob
        self.scale = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.num_local_experts, cfg.hidden_size))
        if cfg.expert_bias:  # gpt-oss's router has a bias
            self.bias = nn.Parameter(torch.empty(cfg.num_local_experts))
        if cfg.correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(cfg.num_local_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, h] -> (scores [T, E] fp32, weights [T, k] fp32, chosen experts [T, k])."""
        bias = getattr(self, "bias", None)
        logits = F.linear(x.float(), self.weight.float(), None if bias is None else bias.float())
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(-1)
        choice = scores
        if hasattr(self, "e_score_correction_bias"):
            choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            choice = self._limit_groups(choice.detach())
        chosen = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, chosen)
        if self.norm:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if self.sigmoid else 0.0))
        return scores, weights * self.scale, chosen

    def _limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """choice [T, E] with the experts outside each token's topk_group best groups at -inf."""
        grouped = choice.reshape(choice.shape[0], self.n_group, -1)  # [T, groups, E / groups]
        best = grouped.topk(2, dim=-1)[0].sum(-1).topk(self.topk_group, dim=-1)[1]  # [T, topk_group]
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).reshape(choice.shape)


class MoE(nn.Module):
    def __init__(self, cfg, hooks: ModelHooks | None = None):
        super().__init__()
        self.hooks = hooks or ModelHooks()
        self.num_experts, self.top_k = cfg.num_local_experts, cfg.num_experts_per_tok
        self.gate = Router(cfg)
        inter, limit = cfg.expert_intermediate_size, cfg.swiglu_limit
        self.experts = Experts(cfg.num_local_experts, cfg.hidden_size, inter, cfg.expert_bias, limit, cfg.swiglu_alpha)
        self.shared_expert = None
        if cfg.shared_intermediate_size:
            self.shared_expert = MLP(cfg, cfg.shared_intermediate_size)
        # Statistics: the last forward's (detached), and one (aux, load) record per real
        # forward (`record` is called by the decoder layer, not by recomputation). The
        # trainer takes the last n-microbatches records (`take_records`): a pipeline
        # stage's first step also runs a metadata-inference forward.
        self.last_aux = self.last_load = None
        self._records: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record(self) -> None:
        if self.last_aux is not None:
            self._records.append((self.last_aux, self.last_load))
            self.last_aux = self.last_load = None

    def take_records(self, last: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (aux loss, tokens per expert) of the last `last` recorded forwards; clears them."""
        out = self._records[-last:] if last else []
        self._records.clear()
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = self.hooks.tokens.split(x.reshape(-1, shape[-1]))  # [T, h]: this rank's share of the tokens
        probs, weights, chosen = self.gate(x)  # [T, E], [T, k], [T, k]
        weights = weights.to(x.dtype)
        flat = chosen.reshape(-1)  # [T * k]
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        dispatch = self.hooks.expert_dispatch or local_dispatch
        routed = dispatch(self.experts, x[order // self.top_k], counts)  # [T * k, h]
        out = torch.zeros_like(x).index_add_(0, order // self.top_k, routed * weights.reshape(-1, 1)[order])
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        aux = self._balance_loss(probs, counts)
        if torch.is_grad_enabled() and self.hooks.aux_loss_scale:
            out = AddAuxLoss.apply(out, aux, self.hooks.aux_loss_scale)
        return self.hooks.tokens.gather(out, shape[:-1].numel()).reshape(shape)

    def _balance_loss(self, probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Switch-style loss over the microbatch's whole token set, as Hugging Face Mixtral
        computes it: E * sum_e f_e * P_e, f_e = routed slots of expert e per token, P_e the
        mean router probability of e. Returns the part this rank backpropagates."""
        sums = torch.cat([counts.to(probs.dtype), probs.new_tensor([probs.shape[0]]), probs.sum(0)])
        # Context and tensor parallelism: the microbatch's tokens are spread over ranks; sum their statistics.
        sums, share = self.hooks.sequence.sum_over_sequence(sums)
        sums, tp_share = self.hooks.tokens.sum_over_shares(sums)
        share *= tp_share
        e = self.num_experts
        slots, tokens, prob_sum = sums[:e].detach(), sums[e].detach(), sums[e + 1 :]
        aux = e * ((slots / tokens) * (prob_sum / tokens)).sum()
        self.last_aux, self.last_load = aux.detach(), counts.detach().float()
        return aux / share  # the sum's backward adds every rank's share
