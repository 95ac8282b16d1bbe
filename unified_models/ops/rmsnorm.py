"""RMSNorm: ``y = x * rsqrt(mean(x^2) + eps) * w`` in fp32, rounded once.

Source: Zhang & Sennrich 2019; transformers ``NemotronHRMSNorm`` (which also
keeps the weight multiply in fp32 and casts once).
"""

from __future__ import annotations

import torch

from ._dispatch import map_row_tiles, use_triton


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
        from .triton.rmsnorm import rms_norm_triton

        return rms_norm_triton(x_TD, weight_D, eps, out_dtype)
    return rms_norm_torch(x_TD, weight_D, eps, out_dtype)


def rms_norm_torch(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """CPU implementation over fixed 16-row tiles (fixed torch call shapes)."""
    w = weight_D.float()

    d = x_TD.shape[1]
    seg = 16384

    def tile(x):
        x = x.float()
        if d <= seg:
            ms = x.square().mean(dim=-1, keepdim=True)
        else:  # rows wider than the grain: fixed segments summed in order
            ss = x[:, :seg].square().sum(dim=-1, keepdim=True)
            for j in range(seg, d, seg):
                ss = ss + x[:, j:j + seg].square().sum(dim=-1, keepdim=True)
            ms = ss / d
        inv = torch.rsqrt(ms + eps)
        return (x * inv * w).to(out_dtype)

    # Keep each torch call below ATen's parallel grain (32768 elements) so the
    # reduction is single-threaded and independent of the thread count.
    rows = max(1, min(16, 16384 // max(1, x_TD.shape[1])))
    return map_row_tiles(tile, x_TD, rows=rows)


def rms_norm_reference(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Oracle in fp64."""
    x = x_TD.double()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight_D.double()
    return y.to(out_dtype or weight_D.dtype)
