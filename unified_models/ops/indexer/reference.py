"""fp64 oracle of the lightning indexer: plain torch per sequence, then a Python sort by
(score descending, entry descending) per token (transformers 5.19 ``DeepseekV4IndexerScorer``
and ``DeepseekV4Indexer``, with the total order of DESIGN.md rule 4)."""

from __future__ import annotations

import torch


def indexer_scores_reference(q_THI: torch.Tensor, weights_TH: torch.Tensor, key_cache: torch.Tensor,
                             block_table_BN: torch.Tensor, seq_idx_T: torch.Tensor, positions_T: torch.Tensor,
                             ratio: int, softmax_scale: float) -> torch.Tensor:
    """fp64 ``score[t, j] = sum_h w[t, h] * relu(q[t, h] . k_j) * softmax_scale``, ``-inf`` where invalid.

    Per sequence b: its keys ``0..J_b-1`` are read from ``key_cache`` through
    ``block_table[b, j // P]``, offset ``j % P`` (``P = key_cache.shape[1]``), and scored for
    all its tokens at once in fp64 (``einsum`` over I, then the sum over h). Entry j is valid
    for a token at position p iff ``j < (p + 1) // ratio``; padding tokens (``p < 0`` or
    ``seq_idx < 0``) have none.

    Returns:
        fp64 ``[T, J]`` on the CPU, ``J`` = the largest number of valid entries of any token.
    """
    pos = positions_T.long().cpu()
    seq = seq_idx_T.long().cpu()
    bound = torch.where((pos >= 0) & (seq >= 0), (pos + 1) // ratio, 0)
    t_all = q_THI.shape[0]
    width = int(bound.max()) if t_all else 0
    out = torch.full((t_all, width), float("-inf"), dtype=torch.float64)
    per_block = key_cache.shape[1]
    table = block_table_BN.long().cpu()
    q = q_THI.detach().double().cpu()
    w = weights_TH.detach().double().cpu()
    kc = key_cache.detach().double().cpu()
    for b in sorted(set(seq[bound > 0].tolist())):
        toks = torch.nonzero((seq == b) & (bound > 0)).view(-1)
        jb = int(bound[toks].max())
        j = torch.arange(jb)
        keys = kc[table[b, j // per_block], j % per_block, 0]  # [J_b, I]
        dots = torch.einsum("thi,ji->thj", q[toks], keys)
        score = (torch.relu(dots) * softmax_scale * w[toks].unsqueeze(-1)).sum(dim=1)  # [T_b, J_b]
        score = score.masked_fill(j.view(1, -1) >= bound[toks].view(-1, 1), float("-inf"))
        out[toks, :jb] = score
    return out


def indexer_topk_reference(q_THI: torch.Tensor, weights_TH: torch.Tensor, key_cache: torch.Tensor,
                           block_table_BN: torch.Tensor, seq_idx_T: torch.Tensor, positions_T: torch.Tensor,
                           ratio: int, topk: int, softmax_scale: float) -> torch.Tensor:
    """Oracle of :func:`~unified_models.ops.indexer.indexer_topk` (same arguments and output).

    The fp64 scores of :func:`indexer_scores_reference`; per token the valid entries sorted
    by ``(score descending, j descending)``, the first ``topk`` kept, sorted by j descending,
    ``-1`` after them. Returns int32 ``[T, topk]`` on the CPU.
    """
    score = indexer_scores_reference(q_THI, weights_TH, key_cache, block_table_BN, seq_idx_T, positions_T,
                                     ratio, softmax_scale)
    pos = positions_T.long().cpu()
    seq = seq_idx_T.long().cpu()
    out = torch.full((q_THI.shape[0], topk), -1, dtype=torch.int32)
    for t in range(q_THI.shape[0]):
        n = (int(pos[t]) + 1) // ratio if pos[t] >= 0 and seq[t] >= 0 else 0
        row = score[t, :n].tolist()
        best = sorted(range(n), key=lambda j: (-row[j], -j))[:topk]
        best.sort(reverse=True)
        out[t, :len(best)] = torch.tensor(best, dtype=torch.int32)
    return out
