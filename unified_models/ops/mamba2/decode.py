"""Mamba-2 uniform decode steps in Triton: the scan and every state write with fixed grids.

A decode step (every sequence 0 or 1 token, :func:`.common.mamba2_decode_metadata`) must
run with launch grids and index tensors that depend on the padded batch size ``B`` only,
so that vLLM can capture it once per size and replay it (``FULL_DECODE_ONLY``). The
general path (:func:`.triton.ssd_chunk_scan_triton` + :func:`.dispatch.commit_ssd_state`,
:func:`.dispatch.write_conv_state`) sizes its grids and its state writes from host index
lists; here:

* the SSD runs the same three kernels of :mod:`.triton` over ``B`` items (one per sequence,
  its current chunk): the cumulative decay, then the **scan** (the token's output from the
  slot's boundary state and its chunk's pending rows), then the **state kernel** with
  ``COMMIT``: a sequence whose token completes its chunk folds the chunk into the boundary
  state and stores it in its own slot (the scan has already read the old one; every program
  reads and writes only its own ``(slot, head, P block)`` tile); a sequence with no complete
  chunk loads and stores nothing. The rows, tiles and operation order of every program are
  those of the general path, so each token's bits are the same.
* :func:`write_pending_rows`: a token that does not complete its chunk is stored as pending
  row ``pos % Q`` of its slot (``x``, ``dt``, ``B``), as ``commit_ssd_state`` does;
* :func:`write_conv_tail`: the slot's conv state becomes the last ``W-1`` inputs (old rows
  shifted by one, the token last; rows at negative positions 0), as ``write_conv_state``.

Every kernel masks sequences with no token (padding: ``seq_len == 0``), so a graph
captured at ``B`` replays with fewer live requests. Copies only: no arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton._common import check_device, next_pow2
from .common import Mamba2Metadata, Mamba2State


@triton.jit
def _pending_kernel(x_ptr, dt_ptr, b_ptr, px_ptr, pdt_ptr, pb_ptr, cu_ptr, p0_ptr, len_ptr, slot_ptr,
                    P, N, HPG,
                    stride_xt, stride_xh, stride_xp, stride_dt_t, stride_dt_h, stride_bt, stride_bg, stride_bn,
                    stride_pxs, stride_pxr, stride_pxh, stride_pxp, stride_pdt_s, stride_pdt_r, stride_pdt_h,
                    stride_pbs, stride_pbr, stride_pbg, stride_pbn,
                    Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    # Per-sequence values are loaded as [BLOCK] vectors of one address (masks stay tensors of
    # the tile's layout; a scalar mask broke the interpreter's loads).
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    p = tl.arange(0, BLOCK_P).to(tl.int64)
    n = tl.arange(0, BLOCK_N).to(tl.int64)
    for what in tl.static_range(3):  # 0: x row [P], 1: dt, 2: B row [N] (one head per group)
        if what == 2:
            lane = n
            lim = N * ((h % HPG) == 0).to(tl.int64)
        elif what == 1:
            lane = p
            lim = 1
        else:
            lane = p
            lim = P
        zero = lane * 0
        p0 = tl.load(p0_ptr + b + zero).to(tl.int64)
        keep = (tl.load(len_ptr + b + zero) > 0) & ((p0 + 1) % Q != 0)  # a completing token is folded, not kept
        m = keep & (lane < lim)
        row = tl.load(cu_ptr + b + zero).to(tl.int64) * m.to(tl.int64)
        slot = tl.load(slot_ptr + b + zero).to(tl.int64)
        i = p0 % Q
        if what == 0:
            v = tl.load(x_ptr + row * stride_xt + h * stride_xh + lane * stride_xp, mask=m)
            tl.store(px_ptr + slot * stride_pxs + i * stride_pxr + h * stride_pxh + lane * stride_pxp,
                     v.to(px_ptr.dtype.element_ty), mask=m)
        elif what == 1:
            v = tl.load(dt_ptr + row * stride_dt_t + h * stride_dt_h + zero, mask=m)
            tl.store(pdt_ptr + slot * stride_pdt_s + i * stride_pdt_r + h * stride_pdt_h + zero, v, mask=m)
        else:
            g = h // HPG
            v = tl.load(b_ptr + row * stride_bt + g * stride_bg + lane * stride_bn, mask=m)
            tl.store(pb_ptr + slot * stride_pbs + i * stride_pbr + g * stride_pbg + lane * stride_pbn,
                     v.to(pb_ptr.dtype.element_ty), mask=m)


def write_pending_rows(x_THP: torch.Tensor, dt_TH: torch.Tensor, B_TGN: torch.Tensor, meta: Mamba2Metadata,
                       state: Mamba2State) -> None:
    """Store each decode token that does not complete its chunk as pending row ``pos % Q``
    of its slot (``state.x``, ``state.dt``, ``state.B``; exact copies, cast to the state dtype).

    Args:
        x_THP: ``[T, H, P]``; dt_TH: fp32 ``[T, H]``; B_TGN: ``[T, G, N]`` (any strides).
        meta: a :func:`.common.mamba2_decode_metadata`; state: the layer's slots.
    """
    T, H, P = x_THP.shape
    G, N = B_TGN.shape[1:]
    B = meta.slot.shape[0]
    check_device("write_pending_rows", x_THP, dt_TH, B_TGN, state.x, state.dt, state.B)
    if B == 0 or T == 0:
        return
    _pending_kernel[(B, H)](
        x_THP, dt_TH, B_TGN, state.x, state.dt, state.B, meta.cu_seqlens, meta.start_pos, meta.seq_len, meta.slot,
        P, N, H // G, *x_THP.stride(), *dt_TH.stride(), *B_TGN.stride(), *state.x.stride(), *state.dt.stride(),
        *state.B.stride(), Q=meta.chunk_size, BLOCK_P=next_pow2(P), BLOCK_N=next_pow2(N), num_warps=1)


@triton.jit
def _conv_tail_kernel(x_ptr, st_ptr, cu_ptr, p0_ptr, len_ptr, slot_ptr, C,
                      stride_xt, stride_xc, stride_ss, stride_sk, stride_sc,
                      WM1: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    cm = c < C
    zero = c * 0  # per-sequence values as vectors of one address (see _pending_kernel)
    p0 = tl.load(p0_ptr + b + zero).to(tl.int64)
    live = tl.load(len_ptr + b + zero) > 0
    row = tl.load(cu_ptr + b + zero).to(tl.int64) * live.to(tl.int64)
    base = st_ptr + tl.load(slot_ptr + b + zero).to(tl.int64) * stride_ss + c * stride_sc
    # rows j = 0..W-3 take old row j+1, row W-2 the token;
    # a row whose position p0 + 1 - (W-1) + j is negative is 0, as write_conv_state writes.
    # ascending j: row j+1 is read before it is overwritten (same thread, same columns)
    for j in tl.static_range(WM1 - 1):
        ok = live & (p0 + 1 - (WM1 - j) >= 0)
        v = tl.load(base + (j + 1) * stride_sk, mask=cm & ok, other=0.0)
        tl.store(base + j * stride_sk, v, mask=cm & live)
    xv = tl.load(x_ptr + row * stride_xt + c * stride_xc, mask=cm & live)
    tl.store(base + (WM1 - 1) * stride_sk, xv.to(st_ptr.dtype.element_ty), mask=cm & live)


def write_conv_tail(x_TC: torch.Tensor, meta: Mamba2Metadata, state: Mamba2State) -> None:
    """``state.conv[slot]`` <- the last ``W-1`` inputs of each decode sequence (exact copies).

    Args:
        x_TC: ``[T, C]`` conv inputs of the step; meta: a :func:`.common.mamba2_decode_metadata`.
    """
    Wm1, C = state.conv.shape[1], state.conv.shape[2]
    B = meta.slot.shape[0]
    check_device("write_conv_tail", x_TC, state.conv)
    if B == 0 or Wm1 == 0 or x_TC.shape[0] == 0:
        return
    block_c = 256
    _conv_tail_kernel[(B, triton.cdiv(C, block_c))](
        x_TC, state.conv, meta.cu_seqlens, meta.start_pos, meta.seq_len, meta.slot, C,
        *x_TC.stride(), *state.conv.stride(), WM1=Wm1, BLOCK_C=block_c, num_warps=4)
