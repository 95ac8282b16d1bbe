"""RoPE's public ops: :func:`rope_cos_sin` (the fp32 tables, the same on every device) and
:func:`apply_rope` (the Triton kernel of :mod:`.triton` on GPU, the CPU path of :mod:`.cpu` otherwise)."""

from __future__ import annotations

import torch

from .._dispatch import use_triton
from .cpu import apply_rope_torch


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
        from .triton import apply_rope_triton

        return apply_rope_triton(x_THE, positions_T, cos_PR, sin_PR)
    return apply_rope_torch(x_THE, positions_T, cos_PR, sin_PR)
