"""The MLP activations' public ops: the Triton kernel (:mod:`.triton`) on GPU, the CPU path (:mod:`.cpu`) otherwise."""

from __future__ import annotations

import torch

from .._dispatch import use_triton
from .cpu import relu2_torch, swiglu_torch


def relu2(x_TF: torch.Tensor) -> torch.Tensor:
    """``relu(x)^2`` elementwise; ``[T, F]`` -> ``[T, F]`` in ``x``'s dtype."""
    if use_triton(x_TF):
        from .triton import relu2_triton

        return relu2_triton(x_TF)
    return relu2_torch(x_TF)


def swiglu(gate_TF: torch.Tensor, up_TF: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in fp32, rounded once; ``[T, F]`` each.

    Raises:
        ValueError: shapes differ.
    """
    if gate_TF.shape != up_TF.shape:
        raise ValueError(f"swiglu: gate {tuple(gate_TF.shape)} and up {tuple(up_TF.shape)} differ")
    if use_triton(gate_TF):
        from .triton import swiglu_triton

        return swiglu_triton(gate_TF, up_TF)
    return swiglu_torch(gate_TF, up_TF)
