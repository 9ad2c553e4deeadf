"""Rotary position embeddings (RoPE) in Hugging Face's half-split layout, for the target and the drafters.

Shape legend: B batch, H heads, T tokens, D head dim.
"""
from __future__ import annotations

import math

import torch

from eyas.models.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies, with Llama-3 scaling when the checkpoint asks for it."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed by `factor`, short ones kept; the band between is interpolated smoothly
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dim (Hugging Face's half-split RoPE layout)."""
    half = x.shape[-1] // 2
    sign = _HALF_SIGNS.get((x.shape[-1], x.dtype, x.device))
    if sign is None:  # roll + a cached sign vector: two ops instead of slice, slice, neg, cat
        with torch.inference_mode(False):  # a normal tensor: also usable by autograd (drafter training)
            sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(dtype=x.dtype, device=x.device)
        _HALF_SIGNS[(x.shape[-1], x.dtype, x.device)] = sign
    return torch.roll(x, half, dims=-1) * sign


_HALF_SIGNS: dict[tuple, torch.Tensor] = {}


def apply_rope(x_BHTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_BTD.unsqueeze(1), sin_BTD.unsqueeze(1)
    return x_BHTD * cos + rotate_half(x_BHTD) * sin
