"""fp64 oracle of RoPE (transformers' ``rotate_half`` formulation)."""

from __future__ import annotations

import torch


def apply_rope_reference(x_THE, positions_T, rotary_dim: int, theta: float,
                         inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """Oracle in fp64 (transformers' ``rotate_half`` formulation). ``inv_freq`` ``[R/2]``: these
    frequencies (e.g. YaRN's, :func:`.yarn.yarn_inv_freq_reference`) instead of
    ``theta ** (-2i / R)``."""
    x = x_THE.double()
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    inv_freq = inv_freq.to(device=x.device, dtype=torch.float64)
    ang = positions_T.double()[:, None] * inv_freq[None, :]
    emb = torch.cat([ang, ang], dim=-1)[:, None, :]
    xr = x[..., :rotary_dim]
    rot = torch.cat([-xr[..., rotary_dim // 2:], xr[..., : rotary_dim // 2]], dim=-1)
    out = torch.cat([xr * emb.cos() + rot * emb.sin(), x[..., rotary_dim:]], dim=-1)
    return out.to(x_THE.dtype)
