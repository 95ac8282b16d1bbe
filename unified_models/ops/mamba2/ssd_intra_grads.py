"""The intra-chunk part of the chunked SSD's backward, fused (Triton): no ``Q x Q`` tensor in memory.

Within chunk ``k`` of a sequence, head ``h`` of group ``g`` (Dao & Gu 2024, "Transformers are SSMs",
Sec. 6, the diagonal blocks; :func:`~.cpu.ssd_chunked_torch_batched`'s ``y_diag``)::

    CB[l, s] = C_l . B_s                      (the group's, shared by its heads)
    Lm[l, s] = exp(acum_l - acum_s), s <= l   (acum: the within-chunk cumulative sum of dt A)
    y_l     += sum_s Lm[l, s] CB[l, s] xd_s   (xd = x dt)

and its gradients, given ``gy`` (the output's)::

    dxd_s  += sum_l M[l, s] gy_l              (M = Lm * CB)
    dM     = (gy_l . xd_s) Lm[l, s]
    dC_l   += sum_{h of g} sum_s dM[l, s] B_s
    dB_s   += sum_{h of g} sum_l dM[l, s] C_l
    dacum_l += sum_s dM[l, s] CB[l, s] - sum_{l'} dM[l', l] CB[l', l]

:func:`~.ssd_backward.ssd_chunked_backward`'s torch form writes ``Lm``, ``M``, ``dM`` and the bf16
terms of their GEMMs as ``[Bt, c, H, Q, Q]`` fp32 tensors (537 MB each at the Nano widths over
16 x 1,024 tokens; 31.5 GB written by the whole scan backward of one layer on the H100, session 35).
Here two kernels recompute the ``Q x Q`` tiles in registers and write only the gradients:

1. :func:`_rows_kernel`, one program per (row tile ``l``, sequence-chunk, group): for each head of the
   group in turn, over the column tiles ``s <= l``: ``CB``, ``Lm``, ``dM`` -> ``dC_l`` (summed over the
   group's heads in order) and the row sums of ``dM * CB`` (fp64).
2. :func:`_cols_kernel`, one program per (column tile ``s``, sequence-chunk, group): for each head, over
   the row tiles ``l >= s``: ``dxd_s`` (per head), ``dB_s`` (summed over the heads in order) and the column
   sums of ``dM * CB`` (fp64).

**Precision** as :func:`~unified_models.ops.grad.helpers.grad_matmul`'s tensor-core path: every dot takes
bf16 operands with fp32 accumulation; an fp32 operand is ``hi + lo`` (two bf16 terms, ``lo x lo``
dropped; one term under ``UM_BACKWARD_GEMM=bf16``); ``B`` and ``C`` are one term when their values are
bf16 values (a bf16 model's activations). The decays come from the fp64 cumulative sums (their
difference in fp64, then ``exp`` in fp32, as the torch form), and ``dacum``'s row and column sums are
fp64 (its two sums cancel). **Deterministic**: each output element is written by one program, which
sums its terms in a fixed order (heads, then tiles by position): no atomics. ``dC`` and ``dB`` split each
head's ``dM`` into bf16 terms where the torch form splits the group's sum: the same bound per term, so the two
agree to ~1e-5 of the gradient, except where a group's heads cancel (their sum far below each term): there
both lose relative accuracy, the fused form up to ~2x more (a break test: 7.6e-3 vs 4.1e-3 against fp64 at a
1e-3 cancellation).

Shapes: ``Bt`` sequences of ``c`` chunks (flattened: ``U = Bt * c``), ``H`` heads in ``G`` groups of
``R = H // G``, chunk ``Q`` rows, head dim ``P``, state ``N``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton._common import check_device, next_pow2, round_to
from ..triton._common import dot_fp32 as _dot

BLOCK_ROWS = 64
"""Rows (and columns) of a ``Q x Q`` tile (64: the ``wgmma`` row count on Hopper; smaller chunks: the
chunk, at least 16, ``tl.dot``'s minimum)."""

NUM_WARPS = 8
"""Warps per program (a 64 x 128 fp32 accumulator and the 64 x 64 tiles live in registers)."""

NUM_STAGES = 1
"""No software pipelining of the tile loops (their loads are a few KB; not tuned on the GPU yet)."""


@triton.jit
def _terms(t, SPLIT: tl.constexpr):
    """fp32 ``t`` as ``(hi, lo)`` bf16 tiles (``lo = bf16(t - hi)``); ``lo`` is unused without ``SPLIT``."""
    hi = round_to(t, tl.bfloat16)
    if SPLIT:
        lo = round_to(t - hi.to(tl.float32), tl.bfloat16)
    else:
        lo = hi
    return hi, lo


@triton.jit
def _mm(a, b, SPLIT_A: tl.constexpr, SPLIT_B: tl.constexpr):
    """fp32 ``a [M, K] @ b [K, N]`` on bf16 tensor cores: ``ah bh + (ah bl + al bh)`` with the terms
    each operand has (``grad_matmul``'s split; ``lo x lo`` dropped)."""
    ah, al = _terms(a, SPLIT_A)
    bh, bl = _terms(b, SPLIT_B)
    out = _dot(ah, bh)
    if SPLIT_B:
        out += _dot(ah, bl)
    if SPLIT_A:
        out += _dot(al, bh)
    return out


@triton.jit
def _tile(ptr, base, rows, rmask, cols, cmask, stride_row):
    """``[len(rows), len(cols)]`` fp32 tile of a row-major block at ``base`` (masked entries read 0)."""
    return tl.load(ptr + base + rows[:, None] * stride_row + cols[None, :],
                   mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)


@triton.jit
def _decay_products(C_l, B_s, acum_ptr, a_base, l, s, lmask, smask, SPLIT_BC: tl.constexpr):
    """``(CB, Lm)`` for rows ``l`` x columns ``s`` of one head: ``CB = C_l B_s^T`` and the decays
    ``exp(acum_l - acum_s)`` on and below the diagonal (0 above it and outside the chunk)."""
    CB = _mm(C_l, tl.trans(B_s), SPLIT_BC, SPLIT_BC)
    a_l = tl.load(acum_ptr + a_base + l, mask=lmask, other=0.0)
    a_s = tl.load(acum_ptr + a_base + s, mask=smask, other=0.0)
    inside = (s[None, :] <= l[:, None]) & lmask[:, None] & smask[None, :]
    Lm = tl.exp(tl.where(inside, (a_l[:, None] - a_s[None, :]).to(tl.float32), float("-inf")))  # 0 outside
    return CB, Lm


@triton.jit
def _program(Q, P, N, G, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's sequence-chunk ``u`` (int64), tile index ``t``, group ``g``; its tile's rows and their mask;
    the ``P`` and ``N`` columns and their masks; ``gq``, row 0 of the chunk's group in ``[U, G, Q, N]``."""
    u, t, g = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    rows = t * BLOCK + tl.arange(0, BLOCK)
    cols_p, cols_n = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_N)
    return u, t, g, rows, rows < Q, cols_p, cols_p < P, cols_n, cols_n < N, (u * G + g) * Q


@triton.jit
def _rows_kernel(xd_ptr, gy_ptr, C_ptr, B_ptr, acum_ptr, dC_ptr, drow_ptr,
                 Q, P, N, G,
                 R: tl.constexpr, SPLIT: tl.constexpr, SPLIT_BC: tl.constexpr,
                 BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    u, pid_l, g, l, lmask, cols_p, pmask, cols_n, nmask, gq = _program(Q, P, N, G, BLOCK, BLOCK_P, BLOCK_N)
    C_l = _tile(C_ptr, gq * N, l, lmask, cols_n, nmask, N)
    dC = tl.zeros([BLOCK, BLOCK_N], tl.float32)
    for r in range(R):
        hq = (u * G * R + g * R + r) * Q  # row 0 of this chunk's head in [U, H, Q, ...]
        gy_l = _tile(gy_ptr, hq * P, l, lmask, cols_p, pmask, P)
        drow = tl.zeros([BLOCK], tl.float64)
        for s0 in range(0, (pid_l + 1) * BLOCK, BLOCK):
            s = s0 + tl.arange(0, BLOCK)
            smask = s < Q
            B_s = _tile(B_ptr, gq * N, s, smask, cols_n, nmask, N)
            CB, Lm = _decay_products(C_l, B_s, acum_ptr, hq, l, s, lmask, smask, SPLIT_BC)
            xd_s = _tile(xd_ptr, hq * P, s, smask, cols_p, pmask, P)
            dM = _mm(gy_l, tl.trans(xd_s), SPLIT, SPLIT) * Lm
            dC += _mm(dM, B_s, SPLIT, SPLIT_BC)
            drow += tl.sum((dM * CB).to(tl.float64), 1)
        tl.store(drow_ptr + hq + l, drow, mask=lmask)
    tl.store(dC_ptr + gq * N + l[:, None] * N + cols_n[None, :], dC, mask=lmask[:, None] & nmask[None, :])


@triton.jit
def _cols_kernel(xd_ptr, gy_ptr, C_ptr, B_ptr, acum_ptr, dB_ptr, dxd_ptr, dcol_ptr,
                 Q, P, N, G,
                 R: tl.constexpr, SPLIT: tl.constexpr, SPLIT_BC: tl.constexpr,
                 BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    u, pid_s, g, s, smask, cols_p, pmask, cols_n, nmask, gq = _program(Q, P, N, G, BLOCK, BLOCK_P, BLOCK_N)
    B_s = _tile(B_ptr, gq * N, s, smask, cols_n, nmask, N)
    dB = tl.zeros([BLOCK, BLOCK_N], tl.float32)
    for r in range(R):
        hq = (u * G * R + g * R + r) * Q
        xd_s = _tile(xd_ptr, hq * P, s, smask, cols_p, pmask, P)
        dxd = tl.zeros([BLOCK, BLOCK_P], tl.float32)
        dcol = tl.zeros([BLOCK], tl.float64)
        for l0 in range(pid_s * BLOCK, Q, BLOCK):
            l = l0 + tl.arange(0, BLOCK)
            lmask = l < Q
            C_l = _tile(C_ptr, gq * N, l, lmask, cols_n, nmask, N)
            CB, Lm = _decay_products(C_l, B_s, acum_ptr, hq, l, s, lmask, smask, SPLIT_BC)
            gy_l = _tile(gy_ptr, hq * P, l, lmask, cols_p, pmask, P)
            dxd += _mm(tl.trans(Lm * CB), gy_l, SPLIT, SPLIT)
            dM = _mm(gy_l, tl.trans(xd_s), SPLIT, SPLIT) * Lm
            dB += _mm(tl.trans(dM), C_l, SPLIT, SPLIT_BC)
            dcol += tl.sum((dM * CB).to(tl.float64), 0)
        tl.store(dxd_ptr + hq * P + s[:, None] * P + cols_p[None, :], dxd, mask=smask[:, None] & pmask[None, :])
        tl.store(dcol_ptr + hq + s, dcol, mask=smask)
    tl.store(dB_ptr + gq * N + s[:, None] * N + cols_n[None, :], dB, mask=smask[:, None] & nmask[None, :])


def ssd_intra_chunk_grads(xd_UHQP: torch.Tensor, gy_UHQP: torch.Tensor, C_UGQN: torch.Tensor,
                          B_UGQN: torch.Tensor, acum_UHQ: torch.Tensor, *, split: bool = True,
                          bc_exact: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The intra-chunk (diagonal-block) gradients of the chunked SSD, fused (module docstring).

    Args:
        xd_UHQP: fp32 ``[U, H, Q, P]``, ``x * dt`` per (sequence-chunk, head, row in the chunk, channel).
        gy_UHQP: fp32 ``[U, H, Q, P]``, the scan output's gradient, same layout.
        C_UGQN, B_UGQN: fp32 ``[U, G, Q, N]``, the group's ``C`` and ``B`` (``G | H``; head ``h`` reads group
            ``h // (H // G)``).
        acum_UHQ: fp64 ``[U, H, Q]``, the within-chunk cumulative sums of ``dt * A`` (``A = -exp(A_log)``).
        split: fp32 operands as ``hi + lo`` bf16 terms (else one, rounded: ``UM_BACKWARD_GEMM=bf16``).
        bc_exact: ``B`` and ``C`` hold bf16 values (one exact term each).

    Returns:
        ``(dxd, dC, dB, dacum)``: fp32 ``[U, H, Q, P]``, fp32 ``[U, G, Q, N]`` twice, fp64 ``[U, H, Q]``: the
        diagonal blocks' contributions (the caller adds the inter-chunk ones).

    Raises:
        ValueError: other shapes, dtypes or devices; non-contiguous tensors; a CPU tensor without the
            interpreter.
    """
    tensors = (xd_UHQP, gy_UHQP, C_UGQN, B_UGQN, acum_UHQ)
    names = ("xd", "gy", "C", "B", "acum")
    if any(t.dim() != d for t, d in zip(tensors, (4, 4, 4, 4, 3))):
        raise ValueError("ssd_intra_chunk_grads: " + ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(names, tensors))
                         + " must be 4-D [U,H,Q,P] x2, [U,G,Q,N] x2 and 3-D [U,H,Q]")
    U, H, Q, P = xd_UHQP.shape
    G, N = C_UGQN.shape[1], C_UGQN.shape[3]
    if (gy_UHQP.shape != xd_UHQP.shape or C_UGQN.shape != B_UGQN.shape or C_UGQN.shape[0] != U
            or C_UGQN.shape[2] != Q or G == 0 or H % G or acum_UHQ.shape != (U, H, Q)
            or any(t.dtype != torch.float32 for t in tensors[:4]) or acum_UHQ.dtype != torch.float64
            or not all(t.is_contiguous() for t in tensors)):
        raise ValueError("ssd_intra_chunk_grads: " + ", ".join(
            f"{n} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}{'' if t.is_contiguous() else ' (not contiguous)'}"
            for n, t in zip(names, tensors)) + " must be contiguous fp32 [U,H,Q,P] x2, [U,G,Q,N] x2 (G | H) and fp64 [U,H,Q]")
    check_device("ssd_intra_chunk_grads", *tensors)
    dev = xd_UHQP.device
    dxd = torch.empty((U, H, Q, P), dtype=torch.float32, device=dev)
    dC = torch.empty((U, G, Q, N), dtype=torch.float32, device=dev)
    dB = torch.empty_like(dC)
    drow = torch.empty((U, H, Q), dtype=torch.float64, device=dev)
    dcol = torch.empty_like(drow)
    if U and Q:
        block = max(16, min(BLOCK_ROWS, next_pow2(Q)))
        meta = dict(R=H // G, SPLIT=bool(split), SPLIT_BC=bool(split and not bc_exact), BLOCK=block,
                    BLOCK_P=max(16, next_pow2(P)), BLOCK_N=max(16, next_pow2(N)), num_warps=NUM_WARPS,
                    num_stages=NUM_STAGES)
        grid = (U, triton.cdiv(Q, block), G)  # U on axis 0: up to 2^31 - 1 programs there, 65,535 on the others
        _rows_kernel[grid](xd_UHQP, gy_UHQP, C_UGQN, B_UGQN, acum_UHQ, dC, drow, Q, P, N, G, **meta)
        _cols_kernel[grid](xd_UHQP, gy_UHQP, C_UGQN, B_UGQN, acum_UHQ, dB, dxd, dcol, Q, P, N, G, **meta)
    return dxd, dC, dB, drow - dcol
