"""The embedding lookup's public op: the Triton kernel (:mod:`.triton`) on GPU, the CPU path (:mod:`.cpu`) otherwise."""

from __future__ import annotations

import torch

from .._dispatch import use_triton
from .cpu import embedding_torch


def _check(input_ids_T: torch.Tensor, weight_VD: torch.Tensor) -> None:
    if input_ids_T.dim() != 1 or input_ids_T.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"input_ids must be 1-D int32/int64, got {tuple(input_ids_T.shape)} {input_ids_T.dtype}")
    if weight_VD.dim() != 2:
        raise ValueError(f"embedding weight must be [V, D], got {tuple(weight_VD.shape)}")


def embedding(input_ids_T: torch.Tensor, weight_VD: torch.Tensor) -> torch.Tensor:
    """Look up token rows.

    Args:
        input_ids_T: int32/int64 ``[T]`` token ids in ``[0, V)``.
        weight_VD: ``[V, D]`` table (any float dtype).

    Returns:
        ``[T, D]`` in ``weight_VD.dtype``.

    Raises:
        ValueError: wrong ranks or dtypes.
    """
    _check(input_ids_T, weight_VD)
    if use_triton(weight_VD):
        from .triton import embedding_triton

        return embedding_triton(input_ids_T, weight_VD)
    return embedding_torch(input_ids_T, weight_VD)
