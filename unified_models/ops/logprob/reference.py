"""fp64 oracle of the logprob op."""

from __future__ import annotations

import torch


def logprobs_reference(logits_TV: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Oracle in fp64, returned as fp32."""
    return torch.log_softmax(logits_TV.double() / temperature, dim=-1).float()
