"""The lightning-indexer op: argument checks, the scores (the Triton kernel of :mod:`.triton`
on GPU, the CPU path of :mod:`.cpu` otherwise), then the total-order selection in torch on
the packed int64 keys (the same code on every device)."""

from __future__ import annotations

import math

import torch

from .._dispatch import use_triton
from .cpu import entry_bounds, indexer_scores_torch

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_INT64_MIN = -(1 << 63)


def _check(q_THI, weights_TH, key_cache, block_table_BN, seq_idx_T, positions_T, ratio, topk, softmax_scale):
    name = "indexer_topk"
    if not isinstance(q_THI, torch.Tensor) or q_THI.dim() != 3:
        raise ValueError(f"{name}: q must be a [T, H, I] tensor, got {getattr(q_THI, 'shape', type(q_THI))}")
    t, h, i = q_THI.shape
    if q_THI.dtype not in _FLOATS:
        raise ValueError(f"{name}: q dtype {q_THI.dtype} is not one of {list(_FLOATS)}")
    if key_cache.dim() != 4 or key_cache.shape[2] != 1 or key_cache.shape[3] != i:
        raise ValueError(f"{name}: key_cache {tuple(key_cache.shape)} must be [N, S // ratio, 1, I] with I = {i} "
                         "(an IndexerKeyCache page tensor)")
    if key_cache.dtype != q_THI.dtype:
        raise ValueError(f"{name}: key_cache dtype {key_cache.dtype} differs from q dtype {q_THI.dtype}")
    if weights_TH.shape != (t, h) or not weights_TH.dtype.is_floating_point:
        raise ValueError(f"{name}: weights {tuple(weights_TH.shape)} {weights_TH.dtype} must be a float [T, H] = "
                         f"[{t}, {h}] tensor")
    if block_table_BN.dim() != 2 or block_table_BN.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: block_table {tuple(block_table_BN.shape)} {block_table_BN.dtype} must be "
                         "int32/int64 [B, max_blocks]")
    for what, x in (("seq_idx", seq_idx_T), ("positions", positions_T)):
        if x.shape != (t,) or x.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: {what} {tuple(x.shape)} {x.dtype} must be int32/int64 [T] = [{t}]")
    for what, v in (("ratio", ratio), ("topk", topk)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: {what} must be an int >= 1, got {v!r}")
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
            or not math.isfinite(softmax_scale):
        raise ValueError(f"{name}: softmax_scale must be a finite float, got {softmax_scale!r}")
    devices = {x.device for x in (q_THI, weights_TH, key_cache, block_table_BN, seq_idx_T, positions_T)}
    if len(devices) != 1:
        raise ValueError(f"{name}: tensors on different devices {sorted(map(str, devices))}")


def _check_coverage(block_table_BN, key_cache, seq_idx_T, bound_T) -> None:
    """CPU only (a host sync): every token's sequence row exists and its table covers its entries."""
    live = bound_T > 0
    if not bool(live.any()):
        return
    seq = seq_idx_T.long()[live]
    if int(seq.max()) >= block_table_BN.shape[0]:
        raise ValueError(f"indexer_topk: seq_idx {int(seq.max())} is past the block table's "
                         f"{block_table_BN.shape[0]} rows")
    need = int(((bound_T[live] - 1) // key_cache.shape[1]).max()) + 1
    if need > block_table_BN.shape[1]:
        raise ValueError(f"indexer_topk: a token needs {need} blocks of indexer keys ({key_cache.shape[1]} entries "
                         f"each) but the block table has {block_table_BN.shape[1]} columns")


def indexer_keys(score_TJ: torch.Tensor, bound_T: torch.Tensor) -> torch.Tensor:
    """int64 total-order keys of fp32 scores (package doc): larger key = selected first.

    ``key[t, j] = (ordered_int32(score + 0.0) << 32) + j`` for ``j < bound[t]``, where the
    order-preserving image keeps a non-negative float's bits and flips the 31 low bits of a
    negative one (so ``-0.0`` made ``+0.0`` by the add, and NaN ranked as ``-inf``); keys
    of columns ``j >= bound[t]`` are the int64 minimum, which no valid key equals (the
    smallest valid key is that of ``-inf``). Equal scores: the larger j has the larger key.

    Args:
        score_TJ: fp32 ``[T, J]`` (J < 2^31); columns past a row's bound are ignored.
        bound_T: int ``[T]``, entries ``0..bound-1`` are valid.

    Returns:
        int64 ``[T, J]``.
    """
    s = score_TJ.float() + 0.0  # -0.0 -> +0.0 (and a fresh contiguous tensor)
    s = torch.where(torch.isnan(s), torch.full_like(s, float("-inf")), s).contiguous()
    bits = s.view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    j = torch.arange(s.shape[-1], device=s.device, dtype=torch.long)
    key = (ordered << 32) + j
    valid = j.view(1, -1) < bound_T.long().view(-1, 1)
    return torch.where(valid, key, torch.full_like(key, _INT64_MIN))


def select_entries(score_TJ: torch.Tensor, bound_T: torch.Tensor, topk: int) -> torch.Tensor:
    """The top ``topk`` valid entries of each row by :func:`indexer_keys`, sorted descending, -1 after.

    Keys of a row are distinct, so ``torch.topk`` (then a sort of the chosen ids, where only
    the -1 fill can repeat) has one answer on every device. Width-independent: extra
    columns past every bound never change a row's result.

    Args:
        score_TJ: fp32 ``[T, J]``; bound_T: int ``[T]``; topk: K >= 1.

    Returns:
        int32 ``[T, K]``: the selected entry ids, descending, then ``-1``.
    """
    t, width = score_TJ.shape
    out = torch.full((t, topk), -1, dtype=torch.int32, device=score_TJ.device)
    k = min(topk, width)
    if t == 0 or k == 0:
        return out
    keys = indexer_keys(score_TJ, bound_T)
    top = torch.topk(keys, k, dim=-1, largest=True, sorted=False).values
    ids = torch.where(top != _INT64_MIN, top & 0xFFFFFFFF, torch.full_like(top, -1))
    out[:, :k] = torch.sort(ids, dim=-1, descending=True).values.to(torch.int32)
    return out


def indexer_scores(q_THI: torch.Tensor, weights_TH: torch.Tensor, key_cache: torch.Tensor,
                   block_table_BN: torch.Tensor, seq_idx_T: torch.Tensor, positions_T: torch.Tensor,
                   ratio: int, softmax_scale: float) -> torch.Tensor:
    """The fp32 indexer scores (package doc) before selection: ``[T, J]``.

    ``J`` is the batch's largest bound on CPU and the block table's ``nb * P`` on the Triton
    path; entries ``j >= (p_t + 1) // ratio`` of row t hold no score (0 on CPU, unset on the
    Triton path). Arguments and errors as :func:`indexer_topk` (without ``topk``).
    """
    _check(q_THI, weights_TH, key_cache, block_table_BN, seq_idx_T, positions_T, ratio, 1, softmax_scale)
    if use_triton(q_THI):
        from .triton import indexer_scores_triton

        return indexer_scores_triton(q_THI, weights_TH, key_cache, block_table_BN, seq_idx_T, positions_T, ratio,
                                     softmax_scale)
    _check_coverage(block_table_BN, key_cache, seq_idx_T, entry_bounds(seq_idx_T, positions_T, ratio))
    return indexer_scores_torch(q_THI, weights_TH, key_cache, block_table_BN, seq_idx_T, positions_T, ratio,
                                softmax_scale)


def indexer_topk(q_THI: torch.Tensor, weights_TH: torch.Tensor, key_cache: torch.Tensor,
                 block_table_BN: torch.Tensor, seq_idx_T: torch.Tensor, positions_T: torch.Tensor,
                 ratio: int, topk: int, softmax_scale: float) -> torch.Tensor:
    """The compressed entries each token attends (DeepSeek-V4 CSA lightning indexer; package doc).

    ``score[t, j] = sum_h w[t, h] * relu(q[t, h] . k_j) * softmax_scale`` for
    ``j < (p_t + 1) // ratio`` (transformers 5.19 ``DeepseekV4IndexerScorer`` /
    ``DeepseekV4Indexer``), then the top ``topk`` by the total order (score descending, ties
    to the larger j), returned sorted by j descending with ``-1`` after them.

    Args:
        q_THI: ``[T, H, I]`` indexer queries (RoPE applied), model dtype (bf16, fp16 or fp32).
        weights_TH: float ``[T, H]`` per-head weights, already scaled by the caller
            (transformers: ``weights_proj(x) * index_n_heads**-0.5``); used in fp32.
        key_cache: ``[N, S // ratio, 1, I]`` IndexerKeyCache pages, ``q``'s dtype, any strides;
            entry j of sequence b at block ``block_table[b, j // (S // ratio)]``, offset
            ``j % (S // ratio)`` (``state.entry_slots``).
        block_table_BN: int32/int64 ``[B, max_blocks]`` of the indexer keys' group.
        seq_idx_T: int ``[T]``, each token's block-table row (``< 0``: padding).
        positions_T: int ``[T]``, each token's position in its own sequence (``< 0``: padding).
        ratio: compression ratio m (4 for CSA), >= 1.
        topk: K (``index_topk``), >= 1.
        softmax_scale: fp32 multiplier of the relu'd dots (``index_head_dim ** -0.5``).

    Returns:
        int32 ``[T, K]``: row t's selected entries, distinct, all ``< (p_t + 1) // ratio``,
        sorted descending, then ``-1`` (all ``-1`` for padding rows). Row t depends only on
        ``q[t]``, ``w[t]`` and its own sequence's keys, never on the batch or block layout.

    Raises:
        ValueError: wrong ranks, shapes, dtypes (q and key_cache must share one float dtype;
            indices int32/int64) or devices; ``ratio`` / ``topk`` not an int >= 1;
            ``softmax_scale`` not finite; on CPU also a ``seq_idx`` past the block table or a
            block table too narrow for a token's entries (CUDA skips that host-synchronising
            check: the caller's tables must cover ``(p + 1) // ratio`` entries).
    """
    _check(q_THI, weights_TH, key_cache, block_table_BN, seq_idx_T, positions_T, ratio, topk, softmax_scale)
    bound = entry_bounds(seq_idx_T, positions_T, ratio)
    if use_triton(q_THI):
        from .triton import chunk_rows, indexer_scores_triton

        t = q_THI.shape[0]
        width = block_table_BN.shape[1] * key_cache.shape[1]
        outs = [select_entries(indexer_scores_triton(q_THI, weights_TH, key_cache, block_table_BN, seq_idx_T,
                                                     positions_T, ratio, softmax_scale, rows=r), bound[r], topk)
                for r in chunk_rows(t, width)]
        return torch.cat(outs) if outs else torch.full((0, topk), -1, dtype=torch.int32, device=q_THI.device)
    _check_coverage(block_table_BN, key_cache, seq_idx_T, bound)
    score = indexer_scores_torch(q_THI, weights_TH, key_cache, block_table_BN, seq_idx_T, positions_T, ratio,
                                 softmax_scale)
    return select_entries(score, bound, topk)
