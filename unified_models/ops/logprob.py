"""Logprob op: ``log_softmax(logits / temperature)`` over the vocabulary in fp32.

DESIGN.md rule 9. The vLLM model class returns these values from
``compute_logits`` (with ``logprobs_mode="raw_logits"`` vLLM only gathers them),
and the trainer calls the same op, so both sides hold the same bits.
Temperature is one IEEE fp32 division per element on both sides.
"""

from __future__ import annotations

import torch

from ._dispatch import ROW_TILE, pad_rows, use_triton

VOCAB_SEGMENT_CPU = 1024
"""Vocabulary elements per torch call on CPU (16 x 1024 stays below ATen's
parallel grain of 32768, so every reduction is single-threaded)."""


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
        from .triton.logprob import logprobs_triton

        return logprobs_triton(logits_TV, temperature)
    return logprobs_torch(logits_TV, temperature)


def logprobs_torch(logits_TV: torch.Tensor, temperature: float) -> torch.Tensor:
    """CPU: 16-row tiles, vocabulary in fixed 1024-wide segments reduced in order."""
    t, v = logits_TV.shape
    seg = VOCAB_SEGMENT_CPU
    x_all = pad_rows(logits_TV.float())
    if temperature != 1.0:
        x_all = x_all / torch.tensor(temperature, dtype=torch.float32)
    outs = []
    for i in range(0, x_all.shape[0], ROW_TILE):
        x = x_all[i:i + ROW_TILE]
        m = torch.full((ROW_TILE,), float("-inf"))
        for j in range(0, v, seg):
            m = torch.maximum(m, x[:, j:j + seg].amax(dim=1))
        ssum = torch.zeros(ROW_TILE)
        for j in range(0, v, seg):
            ssum = ssum + torch.exp(x[:, j:j + seg] - m.unsqueeze(1)).sum(dim=1)
        lse = (m + torch.log(ssum)).unsqueeze(1)
        outs.append(torch.cat([x[:, j:j + seg] - lse for j in range(0, v, seg)], dim=1))
    if not outs:
        return logits_TV.new_zeros((0, v), dtype=torch.float32)
    return torch.cat(outs)[:t]


def logprobs_reference(logits_TV: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Oracle in fp64, returned as fp32."""
    return torch.log_softmax(logits_TV.double() / temperature, dim=-1).float()


def gather_token_logprobs(logprobs_TV: torch.Tensor, token_ids_T: torch.Tensor) -> torch.Tensor:
    """``logprobs_TV[t, token_ids_T[t]]`` -> fp32 ``[T]`` (an exact gather)."""
    return logprobs_TV.gather(1, token_ids_T.long().view(-1, 1)).view(-1)
