"""CPU path of the block-FP8 linear: exact fp64 dot products per 128-long K block, each
rounded once to fp32, scaled, summed over the blocks in fp32 in ascending order (fixed
16-row tiles)."""

from __future__ import annotations

import torch

from .._dispatch import map_row_tiles
from .common import BLOCK, fp8_block_quantize_activation_torch


def fp8_block_linear_torch(x_TK: torch.Tensor, weight_q: torch.Tensor, weight_scale_inv: torch.Tensor,
                           bias_N: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The block-FP8 W8A8 linear on CPU (the package doc's GEMM rule): ``[T, K] -> [T, N]``.

    The activations are quantized here (1x128 tiles, per token). Arguments as
    :func:`~.dispatch.fp8_block_linear_forward` (checked there)."""
    n, k = weight_q.shape
    kb = k // BLOCK
    w = weight_q.double().view(n, kb, BLOCK)
    sw = weight_scale_inv.float().repeat_interleave(BLOCK, 0)[:n]  # [N, Kb]
    b = bias_N.float() if bias_N is not None else None

    def tile(x):
        xq, sx = fp8_block_quantize_activation_torch(x)
        part = torch.einsum("tkb,nkb->tnk", xq.double().view(-1, kb, BLOCK), w).float()  # exact, then fp32
        part = part * sx[:, None, :] * sw[None, :, :]
        acc = torch.zeros_like(part[..., 0])  # 0 + first block: -0.0 becomes +0.0, as in the kernel
        for j in range(kb):
            acc = acc + part[..., j]
        if b is not None:
            acc = acc + b
        return acc.to(out_dtype)

    return map_row_tiles(tile, x_TK)
