"""CPU path of the softmax router's scores (Qwen3-MoE): ``softmax(logits)`` over fixed tiles.

Formula: transformers 5.19 ``Qwen3MoeTopKRouter`` (``softmax(logits, dtype=float)``); rounding
points and the selection rule: package doc of :mod:`.softmax`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._dispatch import map_row_tiles

SCORE_COLS = 64
"""The scores run on ``[16, E padded to a multiple of 64]`` tiles (padding ``-inf``, whose ``exp`` is
0): every element goes through ATen's vectorised ``exp`` and the row sum has one shape whatever the
row's place in the batch (as the sigmoid and sqrt-softplus routers)."""


def softmax_scores_torch(logits_TE: torch.Tensor) -> torch.Tensor:
    """``softmax(logits)`` per row in fp32: ``e = exp(l - max(l))`` (the max is exact), ``p = e / sum(e)``
    (IEEE division; the sum over a fixed ``[16, Epad]`` tile shape). ``[T, E]`` -> fp32 ``[T, E]``."""
    E = logits_TE.shape[1]
    ecols = -(-E // SCORE_COLS) * SCORE_COLS

    def tile(lg):
        z = F.pad(lg.float(), (0, ecols - E), value=float("-inf"))
        e = torch.exp(z - z.amax(dim=-1, keepdim=True))
        return (e / e.sum(dim=-1, keepdim=True))[:, :E]

    return map_row_tiles(tile, logits_TE.float())
