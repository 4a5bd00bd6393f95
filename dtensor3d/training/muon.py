"""optimizer.name: muon. Every 2-D matrix inside the decoder layers (attention's q/k/v/o and
MLA's projections, the MLP's and each shared expert's gate/up/down, each routed expert's
matrices, one expert at a time) on torch.optim.Muon's update of the full matrix; the rest
(embeddings, the head, norms, biases, the router's gate, MTP modules) on AdamW, in one step,
both at the scheduled lr (the Muon group's peak: optimizer.muon_lr).

Muon's update per matrix, as torch 2.13's `_single_tensor_muon`: buf.lerp_(g, 1 - momentum);
u = g.lerp(buf, momentum) (Nesterov) or buf; O = Newton-Schulz(u) (in bf16 as torch's, or in fp32:
optimizer.muon_ns_dtype); p *= 1 - lr * weight_decay;
p -= adjust_lr(lr, shape) * O. The momentum buffer is elementwise, so it lives sharded like
its parameter (and checkpoints save and reshard it like AdamW's moments: "<param>.momentum_buffer"),
in optimizer.state_dtype like them (training/optim_lowp.py);
only Newton-Schulz needs the whole matrix: training/muon_owners.py.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.optim._muon import _adjust_lr

from ..checkpoint.optim_state import new_state
from ..parallel.shards import local
from .muon_owners import orthogonalise, plan_units

ROUTER_GATE = ".gate.weight"  # a MoE layer's router (models/moe.py); the MLP's is gate_proj


def is_muon_matrix(name: str, p: torch.Tensor) -> bool:
    """Item 1's rule: a trained matrix (or stack of expert matrices) inside a decoder layer."""
    # gpt-oss's stacked expert biases [E, width] are biases (AdamW), not matrices
    return (
        name.startswith("model.layers.")
        and p.ndim >= 2
        and p.requires_grad
        and not name.endswith((ROUTER_GATE, "_bias"))
    )


def muon_shape(p: torch.Tensor) -> tuple[int, int]:
    """The matrix's shape as torch.optim.Muon sees it in a Hugging Face model: [out, in]
    (a stacked expert weight [E, in, out] is E Linear weights [out, in])."""
    return (p.shape[2], p.shape[1]) if p.ndim == 3 else (p.shape[0], p.shape[1])


class MuonAdamW(torch.optim.Optimizer):
    """Muon's param group(s) beside an AdamW over the rest; one `state` (AdamW's moments
    and Muon's momentum buffers, keyed by parameter) and one `param_groups` list (AdamW's
    groups, then Muon's), so the loop sets lr and the checkpoint code reads state as for AdamW.
    A group's `lr_scale` multiplies the scheduled lr (Muon's: muon_lr / lr)."""

    def __init__(self, muon_params: list[torch.Tensor], adamw: torch.optim.AdamW, opt):
        defaults = dict(
            lr=opt.lr,
            weight_decay=opt.weight_decay,
            momentum=opt.muon_momentum,
            nesterov=opt.muon_nesterov,
            ns_steps=opt.muon_ns_steps,
            adjust_lr_fn=opt.muon_adjust_lr,
            lr_scale=(opt.muon_lr or opt.lr) / opt.lr,
        )
        super().__init__([{"params": muon_params, "muon": True}], defaults)
        self.adamw = adamw
        adamw.state = self.state  # disjoint keys: one dict for both
        self.param_groups = adamw.param_groups + self.param_groups
        self.units = None  # muon_owners.plan_units, on the first step (every rank of the mesh at once)
        # Newton-Schulz's dtype; not a group key, so checkpoints' param_groups stay as they were
        self.ns_dtype = getattr(torch, opt.muon_ns_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        self.adamw.step()
        for group in self.param_groups:
            if group.get("muon"):
                self._muon_step(group)

    def _muon_step(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if self.units is None:
            self.units = plan_units(group["params"])
        m, updates = group["momentum"], {}
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = new_state(self.adamw, p, "momentum_buffer")
            g, buf = local(p.grad), local(state["momentum_buffer"])
            # buf itself in fp32; bf16 / torchao's 8-bit blocks (state_dtype): read in fp32, updated, written back
            full = buf.dequantize() if hasattr(buf, "codes") else buf.float()
            full.lerp_(g, 1 - m)
            if full is not buf:
                buf.copy_(full)
            updates[p] = g.lerp(full, m) if group["nesterov"] else full
        units = [u for u in self.units if u.param.grad is not None]
        ortho = orthogonalise(units, updates, group["ns_steps"], self.ns_dtype)
        lr = group["lr"]
        for p in params:
            adjusted = _adjust_lr(lr, group["adjust_lr_fn"], muon_shape(p))
            w = local(p)
            w.mul_(1 - lr * group["weight_decay"])
            w.add_(ortho[p], alpha=-adjusted)


def build_muon(model_parts: list[nn.Module], opt, build_adamw) -> MuonAdamW:
    """Muon on item 1's matrices, `build_adamw(params, opt)` (training/optim.py's grouping) on the rest."""
    muon, rest = [], []
    for part in model_parts:
        for name, p in part.named_parameters():
            if p.requires_grad:
                (muon if is_muon_matrix(name, p) else rest).append(p)
    return MuonAdamW(muon, build_adamw(rest, opt), opt)
