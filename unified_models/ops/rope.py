"""Rotary position embedding (RoPE), neox layout (rotate-half).

Source: Su et al. 2021, "RoFormer"; the neox layout of transformers'
``rotate_half`` / ``apply_rotary_pos_emb``: with ``x1 = x[..., :R/2]`` and
``x2 = x[..., R/2:R]`` (R = rotary dim), ``out1 = x1 cos - x2 sin``,
``out2 = x2 cos + x1 sin``; dims past R pass through.

The cos/sin table is computed once per (positions, R, theta, device) in fp64
and rounded to fp32, with one fixed-shape call, so a token's angles depend only
on its position (never on the batch). Application is elementwise in fp32 with
one rounding.
"""

from __future__ import annotations

import torch

from ._dispatch import use_triton

_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def rope_cos_sin(max_positions: int, rotary_dim: int, theta: float,
                 device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos, sin`` tables ``[P, R/2]`` for positions ``0..P-1``.

    ``inv_freq[i] = theta ** (-2i / R)`` (config ``rope_theta``), angles in fp64.

    Raises:
        ValueError: odd or non-positive ``rotary_dim``, non-positive ``theta``/``max_positions``.
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rope: rotary_dim must be a positive even number, got {rotary_dim}")
    if theta <= 0 or max_positions <= 0:
        raise ValueError(f"rope: theta ({theta}) and max_positions ({max_positions}) must be > 0")
    key = (int(max_positions), int(rotary_dim), float(theta), str(torch.device(device)))
    if key not in _TABLES:
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
        ang = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
        _TABLES[key] = (ang.cos().float().to(device), ang.sin().float().to(device))
    return _TABLES[key]


def apply_rope(x_THE: torch.Tensor, positions_T: torch.Tensor, cos_PR: torch.Tensor, sin_PR: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``R = 2 * cos_PR.shape[1]`` dims of every head.

    Args:
        x_THE: ``[T, H, E]`` queries or keys (bf16/fp32).
        positions_T: int ``[T]`` positions in ``[0, P)``.
        cos_PR, sin_PR: fp32 ``[P, R/2]`` from :func:`rope_cos_sin`.

    Returns:
        ``[T, H, E]`` in ``x_THE.dtype``.

    Raises:
        ValueError: ``R > E`` or shape mismatch.
    """
    half = cos_PR.shape[1]
    if x_THE.dim() != 3 or 2 * half > x_THE.shape[2] or sin_PR.shape != cos_PR.shape:
        raise ValueError(f"rope: x {tuple(x_THE.shape)} cannot take a rotary table of {tuple(cos_PR.shape)}")
    if positions_T.shape != (x_THE.shape[0],):
        raise ValueError(f"rope: positions {tuple(positions_T.shape)} do not match {x_THE.shape[0]} tokens")
    if use_triton(x_THE):
        from .triton.rope import apply_rope_triton

        return apply_rope_triton(x_THE, positions_T, cos_PR, sin_PR)
    return apply_rope_torch(x_THE, positions_T, cos_PR, sin_PR)


def apply_rope_torch(x_THE, positions_T, cos_PR, sin_PR) -> torch.Tensor:
    """CPU: gathers are copies and mul/add are single IEEE ops: invariant by construction."""
    half = cos_PR.shape[1]
    c = cos_PR.index_select(0, positions_T.long())[:, None, :]
    s = sin_PR.index_select(0, positions_T.long())[:, None, :]
    x = x_THE.float()
    x1, x2 = x[..., :half], x[..., half:2 * half]
    out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * half:]], dim=-1)
    return out.to(x_THE.dtype)


def apply_rope_reference(x_THE, positions_T, rotary_dim: int, theta: float) -> torch.Tensor:
    """Oracle in fp64 (transformers' ``rotate_half`` formulation)."""
    x = x_THE.double()
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    ang = positions_T.double()[:, None] * inv_freq[None, :]
    emb = torch.cat([ang, ang], dim=-1)[:, None, :]
    xr = x[..., :rotary_dim]
    rot = torch.cat([-xr[..., rotary_dim // 2:], xr[..., : rotary_dim // 2]], dim=-1)
    out = torch.cat([xr * emb.cos() + rot * emb.sin(), x[..., rotary_dim:]], dim=-1)
    return out.to(x_THE.dtype)
