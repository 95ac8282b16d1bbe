"""The logprob ops: :func:`logprobs` (the Triton kernel of :mod:`.triton` on GPU, the
CPU path of :mod:`.cpu` otherwise) and :func:`gather_token_logprobs` (an exact
gather, the same on every device)."""

from __future__ import annotations

import torch

from .._dispatch import use_triton
from .cpu import logprobs_torch


def logprobs(logits_TV: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Row-wise log-softmax with temperature.

    Args:
        logits_TV: ``[T, V]`` fp32/bf16 logits.
        temperature: > 0; 1.0 leaves logits untouched.

    Returns:
        fp32 ``[T, V]`` log-probabilities.

    Raises:
        ValueError: temperature <= 0 or wrong rank.
    """
    if logits_TV.dim() != 2:
        raise ValueError(f"logprobs: logits must be [T, V], got {tuple(logits_TV.shape)}")
    if not temperature > 0:
        raise ValueError(f"logprobs: temperature must be > 0, got {temperature}")
    if use_triton(logits_TV):
        from .triton import logprobs_triton

        return logprobs_triton(logits_TV, temperature)
    return logprobs_torch(logits_TV, temperature)


def gather_token_logprobs(logprobs_TV: torch.Tensor, token_ids_T: torch.Tensor) -> torch.Tensor:
    """``logprobs_TV[t, token_ids_T[t]]`` -> fp32 ``[T]`` (an exact gather)."""
    return logprobs_TV.gather(1, token_ids_T.long().view(-1, 1)).view(-1)
