"""CPU path of RoPE: gathers and single IEEE fp32 mul/add, invariant by construction."""

from __future__ import annotations

import torch


def apply_rope_torch(x_THE, positions_T, cos_PR, sin_PR) -> torch.Tensor:
    """CPU: gathers are copies and mul/add are single IEEE ops: invariant by construction."""
    half = cos_PR.shape[1]
    c = cos_PR.index_select(0, positions_T.long())[:, None, :]
    s = sin_PR.index_select(0, positions_T.long())[:, None, :]
    x = x_THE.float()
    x1, x2 = x[..., :half], x[..., half:2 * half]
    out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * half:]], dim=-1)
    return out.to(x_THE.dtype)
