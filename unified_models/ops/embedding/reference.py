"""Oracle of the embedding lookup (plain advanced indexing)."""

from __future__ import annotations

import torch


def embedding_reference(input_ids_T: torch.Tensor, weight_VD: torch.Tensor) -> torch.Tensor:
    """Oracle: plain advanced indexing."""
    return weight_VD[input_ids_T.long()]
