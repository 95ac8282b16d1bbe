"""CPU path of ``log_softmax(logits / T)``: 16-row tiles, the vocabulary in fixed
1024-wide segments reduced in order."""

from __future__ import annotations

import torch

from .._dispatch import ROW_TILE, pad_rows


VOCAB_SEGMENT_CPU = 1024
"""Vocabulary elements per torch call on CPU (16 x 1024 stays below ATen's
parallel grain of 32768, so every reduction is single-threaded)."""


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
