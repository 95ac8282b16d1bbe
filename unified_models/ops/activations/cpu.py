"""CPU path of the MLP activations: plain torch, fp32 math rounded once, batch-invariant by construction."""

from __future__ import annotations

import torch

from .._dispatch import map_row_tiles


def relu2_torch(x_TF: torch.Tensor) -> torch.Tensor:
    """CPU: relu and square are exact IEEE ops, so any order gives the same bits."""
    return torch.relu(x_TF.float()).square().to(x_TF.dtype)


def swiglu_torch(gate_TF: torch.Tensor, up_TF: torch.Tensor) -> torch.Tensor:
    """CPU: fixed 16-row tiles so the vectorised exp sees the same layout per row."""
    def tile(g, u):
        g = g.float()
        return (g * torch.sigmoid(g) * u.float()).to(gate_TF.dtype)

    return map_row_tiles(tile, gate_TF, up_TF)
