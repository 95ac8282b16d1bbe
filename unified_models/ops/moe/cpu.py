"""CPU path of the MoE experts and combine: exact fp64 dot products rounded once per
expert over fixed 16-row tiles, and an elementwise fp32 combine in slot order."""

from __future__ import annotations

import torch

from .._dispatch import map_row_tiles
from ..linear import round_f64
from .common import ExpertWeight, check_expert_args, expert_rows, expert_weight


def moe_expert_outputs_torch(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, up: ExpertWeight,
                             down: ExpertWeight) -> torch.Tensor:
    """CPU: per expert, exact fp64 dot products of the (dequantized) operands rounded once to fp32,
    the relu2 epilogue in fp32 rounded once to ``x``'s dtype, over fixed 16-row tiles.

    Equal, bit for bit, to the Triton kernel under the interpreter (both are
    exact sums rounded once) while a dot product's terms span fewer than
    ``53 - 16 - log2(K)`` binary orders (docs/consistency.md).
    """
    E, I, D = check_expert_args(x_TD, topk_ids_TK, up, down)
    T, K = topk_ids_TK.shape
    y = torch.zeros(T * K, D, dtype=torch.float32, device=x_TD.device)
    if T == 0:
        return y
    for e, rows in expert_rows(topk_ids_TK, E):
        wu = expert_weight(up, e, x_TD.dtype).double()
        wd = expert_weight(down, e, x_TD.dtype).double()

        def tile(a, wu=wu, wd=wd):
            u = round_f64(a.double() @ wu.t(), torch.float32)
            h = torch.relu(u).square().to(x_TD.dtype)
            return round_f64(h.double() @ wd.t(), torch.float32)

        y[rows] = map_row_tiles(tile, x_TD[rows // K])
    return y


def moe_combine_torch(expert_out_RD, topk_weights_TK, shared_TD, out_dtype) -> torch.Tensor:
    """CPU: elementwise IEEE fp32 multiply and add in slot order (no reduction kernel), one rounding."""
    T, K = topk_weights_TK.shape
    y = expert_out_RD.float().view(T, K, expert_out_RD.shape[1])
    w = topk_weights_TK.float()
    acc = torch.zeros(T, y.shape[2], dtype=torch.float32, device=y.device)
    for k in range(K):
        acc = acc + w[:, k:k + 1] * y[:, k]
    if shared_TD is not None:
        acc = acc + shared_TD.float()
    return acc.to(out_dtype)
