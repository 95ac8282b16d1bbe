"""CPU path of the lightning-indexer scores: plain torch over fixed tiles of 16 tokens x 16
entries (entry tiles aligned at j = 0), dot products exact in fp64 and rounded once to fp32,
the sum over heads a fixed chain of fp32 adds, so no score depends on the batch or on the
host's BLAS (docs/consistency.md, "CPU results do not depend on the host's BLAS")."""

from __future__ import annotations

import torch

from .._dispatch import ROW_TILE, pad_rows

ENTRY_TILE_CPU = 16
"""Compressed entries per tile in the CPU implementation."""


def entry_bounds(seq_idx_T: torch.Tensor, positions_T: torch.Tensor, ratio: int) -> torch.Tensor:
    """Number of compressed entries each token may select: ``(p + 1) // ratio``, 0 for padding.

    Args:
        seq_idx_T, positions_T: int ``[T]``; a token with ``seq_idx < 0`` or ``position < 0``
            is padding.
        ratio: the compression ratio m >= 1.

    Returns:
        int64 ``[T]`` on the tokens' device; entry j is valid for token t iff ``j < bound[t]``.
    """
    pos = positions_T.long()
    live = (pos >= 0) & (seq_idx_T.long() >= 0)
    return torch.where(live, (pos + 1) // ratio, torch.zeros_like(pos))


def indexer_scores_torch(q_THI: torch.Tensor, weights_TH: torch.Tensor, key_cache: torch.Tensor,
                         block_table_BN: torch.Tensor, seq_idx_T: torch.Tensor, positions_T: torch.Tensor,
                         ratio: int, softmax_scale: float) -> torch.Tensor:
    """CPU implementation of the scores (package doc): fp32 ``[T, J]``, ``J = max bound``.

    Per tile of 16 tokens (padded) and 16 entries (``j0 = 0, 16, ...`` up to the tile's
    largest bound) the keys are gathered through the block table on their own (an entry
    outside a token's bound reads block 0 and is replaced by 0), then:

    * ``dot = q @ k^T`` as one fp64 batched matmul of fixed shape ``[16, H, I] x [16, I, 16]``:
      the products of bf16/fp16 operands are exact in fp64 and their sum is exact while the
      products of one dot span fewer than ``53 - 22 - ceil(log2 I)`` binary orders, so the
      result does not depend on BLAS's order, threads or the row's place; rounded once to
      fp32. (fp32 operands: exact products, fp64 sum in BLAS order, then rounded; it can
      change the fp32 bit only within 2^-29 relative of a rounding boundary.)
    * ``s = (relu(dot) * softmax_scale) * w`` in fp32, each one rounding;
    * ``score = (((s_0 + s_1) + s_2) + ...) + s_{H-1}``: elementwise fp32 adds, no reduction
      kernel that could reorder them.

    Columns ``j >= bound[t]`` of row t are 0 and must not be used (:func:`.dispatch.select_entries`
    masks them). Weights are converted to fp32 (exact for bf16/fp16).
    """
    t_all, h, i_dim = q_THI.shape
    per_block = key_cache.shape[1]
    nb = block_table_BN.shape[1]
    dev = q_THI.device
    bound = entry_bounds(seq_idx_T, positions_T, ratio)
    width = int(bound.max().item()) if t_all else 0
    out = torch.zeros((t_all, width), dtype=torch.float32, device=dev)
    if width == 0:
        return out
    scale = torch.tensor(float(softmax_scale), dtype=torch.float32, device=dev)
    q_pad = pad_rows(q_THI)
    w_pad = pad_rows(weights_TH.float())
    b_pad = pad_rows(bound.view(-1, 1)).view(-1)  # padding rows: bound 0
    s_pad = pad_rows(seq_idx_T.long().clamp(min=0).view(-1, 1)).view(-1)
    ar = torch.arange(ENTRY_TILE_CPU, device=dev)
    et = ENTRY_TILE_CPU
    for r0 in range(0, q_pad.shape[0], ROW_TILE):
        b = b_pad[r0:r0 + ROW_TILE]
        jmax = int(b.max().item())
        if jmax == 0:
            continue
        qd = q_pad[r0:r0 + ROW_TILE].double()  # [16, H, I]
        w = w_pad[r0:r0 + ROW_TILE].view(ROW_TILE, h, 1)  # [16, H, 1] fp32
        rows = block_table_BN[s_pad[r0:r0 + ROW_TILE]].long()  # [16, nb]
        r1 = min(r0 + ROW_TILE, t_all)
        for j0 in range(0, jmax, et):
            j = j0 + ar  # [16] entry ids
            valid = j.view(1, et) < b.view(ROW_TILE, 1)  # [16 tokens, 16 entries]
            col = (j // per_block).clamp(max=nb - 1)
            blk = torch.where(valid, rows[:, col], 0)  # entries outside the bound read block 0
            off = (j % per_block).view(1, et).expand(ROW_TILE, et)
            k = key_cache[blk, off, 0].double()  # [16, 16, I]
            k = torch.where(valid.view(ROW_TILE, et, 1), k, 0.0)  # (stale NaNs never enter)
            dot = torch.matmul(qd, k.transpose(1, 2)).float()  # [16, H, 16]: exact, rounded once
            s = torch.relu(dot) * scale * w
            tot = s[:, 0]
            for hh in range(1, h):
                tot = tot + s[:, hh]
            j1 = min(j0 + et, width)
            out[r0:r1, j0:j1] = tot[:r1 - r0, :j1 - j0]
    return out
