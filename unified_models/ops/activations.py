"""MLP activations, fp32 math rounded once.

* relu2: ``relu(x)^2`` (Nemotron-H ``mlp_hidden_act="relu2"``, So et al. 2021 "Primer").
* swiglu: ``silu(gate) * up`` (Shazeer 2020), rounded once before any quantization.
"""

from __future__ import annotations

import torch

from ._dispatch import map_row_tiles, use_triton


def relu2(x_TF: torch.Tensor) -> torch.Tensor:
    """``relu(x)^2`` elementwise; ``[T, F]`` -> ``[T, F]`` in ``x``'s dtype."""
    if use_triton(x_TF):
        from .triton.activations import relu2_triton

        return relu2_triton(x_TF)
    return relu2_torch(x_TF)


def relu2_torch(x_TF: torch.Tensor) -> torch.Tensor:
    """CPU: relu and square are exact IEEE ops, so any order gives the same bits."""
    return torch.relu(x_TF.float()).square().to(x_TF.dtype)


def relu2_reference(x_TF: torch.Tensor) -> torch.Tensor:
    return torch.relu(x_TF.double()).pow(2).to(x_TF.dtype)


def swiglu(gate_TF: torch.Tensor, up_TF: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in fp32, rounded once; ``[T, F]`` each.

    Raises:
        ValueError: shapes differ.
    """
    if gate_TF.shape != up_TF.shape:
        raise ValueError(f"swiglu: gate {tuple(gate_TF.shape)} and up {tuple(up_TF.shape)} differ")
    if use_triton(gate_TF):
        from .triton.activations import swiglu_triton

        return swiglu_triton(gate_TF, up_TF)
    return swiglu_torch(gate_TF, up_TF)


def swiglu_torch(gate_TF: torch.Tensor, up_TF: torch.Tensor) -> torch.Tensor:
    """CPU: fixed 16-row tiles so the vectorised exp sees the same layout per row."""
    def tile(g, u):
        g = g.float()
        return (g * torch.sigmoid(g) * u.float()).to(gate_TF.dtype)

    return map_row_tiles(tile, gate_TF, up_TF)


def swiglu_reference(gate_TF: torch.Tensor, up_TF: torch.Tensor) -> torch.Tensor:
    g = gate_TF.double()
    return (g * torch.sigmoid(g) * up_TF.double()).to(gate_TF.dtype)
