"""Metrics: a console line and a metrics.jsonl record per logged step, a loss-curve SVG at
the end, and the FLOP / memory arithmetic behind tokens/s, MFU and peak memory."""

from __future__ import annotations

import json
import os
import resource
import sys

import torch
import yaml

# Dense bf16 peak FLOP/s by device name fragment (no sparsity).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def flops_per_token(cfg, seq_len: int) -> float:
    """Training FLOPs per token: 6 * non-embedding params + attention (PaLM's estimate)."""
    h, L = cfg.hidden_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * cfg.head_dim
    ffn = 3 * h * cfg.intermediate_size
    if cfg.num_local_experts:  # MoE layers: top-k experts, the router and any shared expert per token
        moe = ffn * cfg.num_experts_per_tok + h * cfg.num_local_experts + 3 * h * cfg.shared_expert_intermediate_size
        n_moe = L if cfg.moe_layers is None else len(cfg.moe_layers)
        ffn_total = n_moe * moe + (L - n_moe) * ffn
    else:
        ffn_total = L * ffn
    dense = L * (h * h * 2 + h * kv * 2) + ffn_total + h * cfg.vocab_size  # the head counts, the lookup not
    return 6 * dense + 12 * L * h * seq_len


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (peak RSS)


class MetricsLog:
    """Writes <run_dir>/metrics.jsonl and <run_dir>/recipe.yaml; only rank 0 writes.

    `resume`: the step a resumed run continues from (0: a fresh run). The file's earlier
    records up to that step are kept and new ones appended; later ones (from a run that
    went past the checkpoint) are dropped, so each step appears once."""

    def __init__(self, run_dir: str, recipe_dict: dict, enabled: bool, resume: int = 0):
        self.enabled, self.run_dir, self.records, self.earlier = enabled, run_dir, [], []
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "recipe.yaml"), "w") as f:
            yaml.safe_dump(recipe_dict, f, sort_keys=False)
        path = os.path.join(run_dir, "metrics.jsonl")
        if resume and os.path.exists(path):
            with open(path) as f:
                self.earlier = [r for r in map(json.loads, f) if r["step"] <= resume]
        self.file = open(path, "w")
        for record in self.earlier:
            self.file.write(json.dumps(record) + "\n")

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.records.append(record)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        parts = [
            f"step {record['step']:>5}",
            f"loss {record['loss']:.4f}",
            f"grad_norm {record['grad_norm']:.3f}",
            f"lr {record['lr']:.2e}",
            f"tok/s {record['tokens_per_sec']:,.0f}",
            f"{record['ms_per_step']:.0f} ms",
            f"mem {record['peak_mem_gib']:.2f} GiB",
        ]
        if "aux_loss" in record:
            parts.append(
                f"aux {record['aux_loss']:.4f} | expert load max/mean {record['expert_load_max_over_mean']:.2f}"
            )
        if record.get("mfu") is not None:
            parts.append(f"mfu {100 * record['mfu']:.1f}%")
        print(" | ".join(parts), file=sys.stdout, flush=True)

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            points = [(r["step"], r["loss"]) for r in self.earlier + self.records]
            if points:
                write_loss_svg(os.path.join(self.run_dir, "loss.svg"), points)


def write_loss_svg(path: str, points: list[tuple[int, float]], width: int = 640, height: int = 360) -> None:
    """A dependency-free line chart of loss against step."""
    pad = 48
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    y0, y1 = min(ys), max(max(ys), min(ys) + 1e-9)
    sx = lambda x: pad + (x - x0) / (x1 - x0) * (width - 2 * pad)  # noqa: E731
    sy = lambda y: height - pad - (y - y0) / (y1 - y0) * (height - 2 * pad)  # noqa: E731
    line = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)
    svg = f"""<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" \
font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="black"/>
<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>
<text x="{width / 2}" y="{height - 12}" text-anchor="middle">step</text>
<text x="14" y="{height / 2}" transform="rotate(-90 14 {height / 2})" text-anchor="middle">loss</text>
<text x="{pad - 4}" y="{pad + 4}" text-anchor="end">{y1:.3f}</text>
<text x="{pad - 4}" y="{height - pad}" text-anchor="end">{y0:.3f}</text>
<text x="{pad}" y="{height - pad + 16}" text-anchor="middle">{x0}</text>
<text x="{width - pad}" y="{height - pad + 16}" text-anchor="middle">{x1}</text>
<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{line}"/>
</svg>
"""
    with open(path, "w") as f:
        f.write(svg)
