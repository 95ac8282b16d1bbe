"""RMSNorm's public op: the Triton kernel (:mod:`.triton`) on GPU, the CPU path (:mod:`.cpu`) otherwise."""

from __future__ import annotations

import torch

from .._dispatch import use_triton
from .cpu import rms_norm_torch


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
