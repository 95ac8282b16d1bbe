"""CPU path of the embedding lookup (``index_select``: an exact copy)."""

from __future__ import annotations

import torch


def embedding_torch(input_ids_T: torch.Tensor, weight_VD: torch.Tensor) -> torch.Tensor:
    """CPU implementation: ``index_select`` is a copy, trivially batch-invariant."""
    return weight_VD.index_select(0, input_ids_T.long())
