"""fp64 oracles of the MLP activations."""

from __future__ import annotations

import torch


def relu2_reference(x_TF: torch.Tensor) -> torch.Tensor:
    return torch.relu(x_TF.double()).pow(2).to(x_TF.dtype)


def swiglu_reference(gate_TF: torch.Tensor, up_TF: torch.Tensor) -> torch.Tensor:
    g = gate_TF.double()
    return (g * torch.sigmoid(g) * up_TF.double()).to(gate_TF.dtype)
