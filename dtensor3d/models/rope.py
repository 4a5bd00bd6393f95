"""Rotary position embeddings and Hugging Face's RoPE scalings (rope_type linear, llama3,
yarn), as single-device functions of the model config and the tokens' global positions.

Positions always come from the caller (context parallelism's load-balanced chunks, the KV
cache's offset), so a scaling only changes the frequencies, never which position a token has.
"""

from __future__ import annotations

import math

import torch


def inv_freq(cfg) -> tuple[torch.Tensor, float]:
    """The inverse frequencies [head_dim / 2] of `cfg`'s RoPE and the factor on cos and sin."""
    dim, theta = cfg.head_dim, cfg.rope_theta
    # on the CPU even under build_on_meta's meta device: the tables are computed, never loaded
    base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
    rope = cfg.rope_scaling or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "linear":
        return base / rope["factor"], 1.0
    if kind == "llama3":
        return _llama3(base, rope), 1.0
    if kind == "yarn":
        return _yarn(base, rope, dim, theta)
    return base, 1.0


def _llama3(base: torch.Tensor, rope: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth blend between."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > original / low, base / factor, base)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, blended, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(base: torch.Tensor, rope: dict, dim: int, theta: float) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated below a ramp of rotation counts, extrapolated above, and an
    attention factor on cos and sin."""
    factor, original = rope["factor"], rope["original_max_position_embeddings"]
    attention = rope.get("attention_factor")
    if attention is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all else _yarn_mscale(factor)

    def correction(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction(rope.get("beta_fast") or 32), correction(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolate = 1 - ramp
    return base / factor * (1 - extrapolate) + base * extrapolate, float(attention)


def rope_tables(freqs: torch.Tensor, scale: float, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [seq, head_dim] for the given (global) token positions [seq], or
    [batch, 1, seq, head_dim] for per-sample positions [batch, seq] (packed documents)."""
    angles = positions.float()[..., None] * freqs.to(positions.device)  # [..., seq, head_dim / 2]
    if positions.dim() == 2:
        angles = angles[:, None]  # [batch, 1 (heads), seq, head_dim / 2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * scale, angles.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; Hugging Face's rotate-half convention."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).type_as(x)
