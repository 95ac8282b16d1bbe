"""Lightning-indexer scores in Triton (package doc for the math).

One program per (token, entry tile of ``BLOCK_J`` entries aligned at j = 0); grid
``(T, cdiv(nb * P, BLOCK_J))`` from shapes only (no host sync, CUDA-graph safe). A program
whose tile starts at or past its token's bound ``(p + 1) // ratio`` does nothing. Otherwise:

* its ``BLOCK_J`` keys are gathered one by one through the block table (``block_table[seq,
  j // P]``, offset ``j % P``; loads masked to ``j < bound``, so block-table entries past the
  token's entries are never read): ``kT [I_PAD, BLOCK_J]``;
* ``dot = q[t] [H_PAD, I_PAD] @ kT`` (rows past H and dims past I are zeros): on CUDA a
  tensor-core ``tl.dot`` with fp32 accumulation (fp32 operands: ``input_precision="ieee"``);
  under the interpreter :func:`~unified_models.ops.triton._common.interpreter_dot` (exact fp64
  for bf16/fp16, no BLAS) rounded once to fp32;
* ``s = (relu(dot) * softmax_scale) * w[t, h]`` in fp32 (padded heads have ``w = 0``);
* ``score = tl.sum(s, axis=0)`` (under the interpreter numpy's reduction over the outer
  axis, i.e. ``h = 0, 1, ...`` in order, which is the CPU path's chain).

Every constexpr (``H_PAD``, ``I_PAD``, ``BLOCK_J``, warps) depends only on the model (H, I,
dtype), so a token's scores are the same bits in any batch, chunk or block layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton._common import _INTERP, INTERPRET, check_device, interpreter_dot, next_pow2

BLOCK_J = 16 if INTERPRET else 64
"""Entries per program (a ``tl.dot`` N dimension, >= 16)."""

MAX_SCORES_PER_CHUNK = 1 << 26
"""Scores materialised per chunk of tokens (fp32; the int64 keys take twice that)."""


@triton.jit
def _indexer_score_kernel(q_ptr, w_ptr, kc_ptr, bt_ptr, seq_ptr, pos_ptr, out_ptr,
                          stride_qt, stride_qh, stride_qi, stride_wt, stride_wh,
                          stride_kn, stride_kp, stride_ki, stride_bt, stride_ot,
                          P, NB, ratio, scale,
                          H: tl.constexpr, H_PAD: tl.constexpr, I: tl.constexpr, I_PAD: tl.constexpr,
                          BLOCK_J: tl.constexpr, FP32_DOT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    jt = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    seq = tl.load(seq_ptr + t).to(tl.int64)
    bound = tl.where((pos >= 0) & (seq >= 0), (pos + 1) // ratio, 0)
    j0 = jt.to(tl.int64) * BLOCK_J
    if j0 < bound:
        j = j0 + tl.arange(0, BLOCK_J)
        mask_j = j < bound
        blk = tl.load(bt_ptr + seq * stride_bt + j // P, mask=mask_j & (j // P < NB), other=0).to(tl.int64)
        off = j % P
        i = tl.arange(0, I_PAD)
        mask_i = i < I
        kT = tl.load(kc_ptr + i[:, None] * stride_ki + (blk * stride_kn + off * stride_kp)[None, :],
                     mask=mask_i[:, None] & mask_j[None, :], other=0.0)  # [I_PAD, BLOCK_J]
        hh = tl.arange(0, H_PAD)
        mask_h = hh < H
        q = tl.load(q_ptr + t * stride_qt + hh[:, None] * stride_qh + i[None, :] * stride_qi,
                    mask=mask_h[:, None] & mask_i[None, :], other=0.0)  # [H_PAD, I_PAD]
        if _INTERP:  # no BLAS under the interpreter (see interpreter_dot)
            dot = interpreter_dot(q, kT).to(tl.float32)
        elif FP32_DOT:
            dot = tl.dot(q, kT, input_precision="ieee")
        else:
            dot = tl.dot(q, kT)
        w = tl.load(w_ptr + t * stride_wt + hh * stride_wh, mask=mask_h, other=0.0).to(tl.float32)
        s = tl.maximum(dot, 0.0) * scale
        s = s * w[:, None]
        score = tl.sum(s, axis=0)
        tl.store(out_ptr + t * stride_ot + j, score, mask=mask_j)


def tile_shape(H: int, I: int) -> tuple[int, int]:
    """``(H_PAD, I_PAD)``: the head and head-dim extents of a program's tiles (>= 16, powers of two)."""
    return max(16, next_pow2(H)), max(16, next_pow2(I))


def indexer_scores_triton(q_THI: torch.Tensor, weights_TH: torch.Tensor, key_cache: torch.Tensor,
                          block_table_BN: torch.Tensor, seq_idx_T: torch.Tensor, positions_T: torch.Tensor,
                          ratio: int, softmax_scale: float, rows: slice | None = None) -> torch.Tensor:
    """Scores of the tokens ``rows`` (default all) over the block table's full width.

    Args: as :func:`unified_models.ops.indexer.indexer_topk` (already checked by it).

    Returns:
        fp32 ``[T_rows, nb * P]``; columns ``j >= bound[t]`` are unset (garbage) and must be
        masked by the caller (:func:`.dispatch.select_entries` does).

    Raises:
        ValueError: tensors on different devices, or on CPU without ``TRITON_INTERPRET=1``.
    """
    check_device("indexer_scores_triton", q_THI, weights_TH, key_cache, block_table_BN, seq_idx_T, positions_T)
    rows = rows if rows is not None else slice(0, q_THI.shape[0])
    q = q_THI[rows]
    w = weights_TH[rows].float()
    seq = seq_idx_T[rows]
    pos = positions_T[rows]
    t_all, h, i_dim = q.shape
    per_block, nb = key_cache.shape[1], block_table_BN.shape[1]
    width = nb * per_block
    out = torch.empty((t_all, width), dtype=torch.float32, device=q.device)
    if t_all == 0 or width == 0:
        return out
    h_pad, i_pad = tile_shape(h, i_dim)
    grid = (t_all, triton.cdiv(width, BLOCK_J))
    _indexer_score_kernel[grid](
        q, w, key_cache, block_table_BN, seq, pos, out,
        q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(3), block_table_BN.stride(0), out.stride(0),
        per_block, nb, ratio, float(softmax_scale),
        H=h, H_PAD=h_pad, I=i_dim, I_PAD=i_pad, BLOCK_J=BLOCK_J,
        FP32_DOT=q.dtype == torch.float32, num_warps=4)
    return out


def chunk_rows(T: int, width: int) -> list[slice]:
    """Token chunks for the CUDA selection: at most :data:`MAX_SCORES_PER_CHUNK` scores each
    (a function of the shapes only; rows are independent, so chunking changes no bit)."""
    step = max(1, MAX_SCORES_PER_CHUNK // max(width, 1))
    return [slice(r, min(r + step, T)) for r in range(0, T, step)]
