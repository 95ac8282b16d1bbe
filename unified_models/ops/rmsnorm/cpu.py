"""CPU path of RMSNorm: fp32 math over fixed row tiles below ATen's parallel grain, rounded once."""

from __future__ import annotations

import torch

from .._dispatch import map_row_tiles


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


def add_rms_norm_torch(residual_TD: torch.Tensor, update_TD: torch.Tensor, weight_D: torch.Tensor, eps: float,
                       out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU fused residual add + RMSNorm: torch's elementwise ``residual + update`` (one rounding of the
    fp32 sum of two stream-dtype values, like the kernel) then :func:`rms_norm_torch`."""
    s_TD = residual_TD + update_TD
    return s_TD, rms_norm_torch(s_TD, weight_D, eps, out_dtype)
