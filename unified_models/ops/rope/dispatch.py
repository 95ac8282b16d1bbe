"""RoPE's public ops: :func:`rope_cos_sin` (the fp32 tables, the same on every device) and
:func:`apply_rope` (the Triton kernel of :mod:`.triton` on GPU, the CPU path of :mod:`.cpu` otherwise)."""

from __future__ import annotations

import torch

from .._dispatch import use_triton
from .cpu import apply_rope_torch
from .yarn import yarn_inv_freq


_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
"""Memoized tables. They are built outside inference mode (``torch.inference_mode(False)``): a
table first built during a vLLM rollout step is later saved for backward by the trainer, which
an inference tensor cannot be."""


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
        with torch.inference_mode(False):
            inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
            ang = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
            _TABLES[key] = (ang.cos().float().to(device), ang.sin().float().to(device))
    return _TABLES[key]


def rope_cos_sin_yarn(max_positions: int, rotary_dim: int, theta: float, factor: float,
                      original_max_position_embeddings: int, beta_fast: float = 32.0, beta_slow: float = 1.0,
                      truncate: bool = True, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos, sin`` tables ``[P, R/2]`` of YaRN RoPE (attention factor 1) for positions ``0..P-1``.

    ``inv_freq``: :func:`.yarn.yarn_inv_freq` (fp32, bitwise transformers 5.19's
    ``_compute_yarn_parameters``); angles ``p * inv_freq`` and their cos/sin in fp64 from
    those fp32 frequencies, rounded once to fp32 (transformers forms the angle in fp32:
    ours are the exact values of the same frequencies). Memoized per (P, R, theta, YaRN
    parameters, device) like :func:`rope_cos_sin`.

    Raises:
        ValueError: as :func:`.yarn.yarn_inv_freq`, or a non-positive ``max_positions``.
    """
    if max_positions <= 0:
        raise ValueError(f"rope: max_positions ({max_positions}) must be > 0")
    key = ("yarn", int(max_positions), int(rotary_dim), float(theta), float(factor),
           int(original_max_position_embeddings), float(beta_fast), float(beta_slow), bool(truncate),
           str(torch.device(device)))
    if key not in _TABLES:
        with torch.inference_mode(False):
            inv_freq = yarn_inv_freq(rotary_dim, theta, factor, original_max_position_embeddings, beta_fast,
                                     beta_slow, truncate).double()
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
