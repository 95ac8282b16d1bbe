"""RMSNorm's public op: the Triton kernel (:mod:`.triton`) on GPU, the CPU path (:mod:`.cpu`) otherwise."""

from __future__ import annotations

import torch

from .._dispatch import use_triton
from .cpu import add_rms_norm_torch, rms_norm_torch


def rms_norm(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Row-wise RMSNorm.

    Args:
        x_TD: ``[T, D]`` bf16/fp32 activations.
        weight_D: ``[D]`` gain.
        eps: added to the mean square (config ``layer_norm_epsilon``).
        out_dtype: result dtype (default ``weight_D.dtype``).

    Returns:
        ``[T, D]`` in ``out_dtype``; each row depends only on itself.

    Raises:
        ValueError: shape mismatch.
    """
    if x_TD.dim() != 2 or weight_D.shape != (x_TD.shape[1],):
        raise ValueError(f"rms_norm: x {tuple(x_TD.shape)} and weight {tuple(weight_D.shape)} do not match")
    out_dtype = out_dtype or weight_D.dtype
    if use_triton(x_TD):
        from .triton import rms_norm_triton

        return rms_norm_triton(x_TD, weight_D, eps, out_dtype)
    return rms_norm_torch(x_TD, weight_D, eps, out_dtype)


def add_rms_norm(residual_TD: torch.Tensor, update_TD: torch.Tensor, weight_D: torch.Tensor, eps: float,
                 out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm (vLLM's ``fused_add_rms_norm``): the stream after a sublayer
    and the next sublayer's normed input, from one pass over the rows.

    Args:
        residual_TD: ``[T, D]`` bf16/fp32 residual stream.
        update_TD: ``[T, D]`` the sublayer's output, same dtype as ``residual_TD``.
        weight_D: ``[D]`` gain of the next norm.
        eps: added to the mean square (the next norm's ``eps``).
        out_dtype: dtype of the normed output (default ``weight_D.dtype``).

    Returns:
        ``(s_TD, y_TD)``: ``s_TD = residual_TD + update_TD`` (the stream's dtype, one rounding of the
        exact sum) and ``y_TD = rms_norm(s_TD, weight_D, eps, out_dtype)``, bitwise equal to the two
        ops run one after the other; each row depends only on itself.

    Raises:
        ValueError: shape or dtype mismatch (names both).
    """
    if residual_TD.dim() != 2 or update_TD.shape != residual_TD.shape or update_TD.dtype != residual_TD.dtype:
        raise ValueError(f"add_rms_norm: update {tuple(update_TD.shape)} {update_TD.dtype} must match the "
                         f"[T, D] residual {tuple(residual_TD.shape)} {residual_TD.dtype}")
    if weight_D.shape != (residual_TD.shape[1],):
        raise ValueError(f"add_rms_norm: x {tuple(residual_TD.shape)} and weight {tuple(weight_D.shape)} do not match")
    out_dtype = out_dtype or weight_D.dtype
    if use_triton(residual_TD):
        from .triton import add_rms_norm_triton

        return add_rms_norm_triton(residual_TD, update_TD, weight_D, eps, out_dtype)
    return add_rms_norm_torch(residual_TD, update_TD, weight_D, eps, out_dtype)
