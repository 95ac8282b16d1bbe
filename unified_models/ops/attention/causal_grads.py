"""Gradients of causal self-attention over packed whole sequences, fused and deterministic (Triton).

The trainer's attention backward (:mod:`.backward`) recomputes each sequence's attention; for a
half-precision model's whole prompts (every query row is a key row, keys from position 0, no
window, no sink) this module does it the way FlashAttention-2's backward does (Dao 2023,
"FlashAttention-2", Algorithm 2; the Triton tutorial ``06-fused-attention.py``'s two-loop form):

1. :func:`_stats_kernel`, one program per (query tile, sequence, query head): the online softmax
   over the row's keys ``0..i`` (fp32 scores ``q k^T``, probabilities rounded to the operand dtype
   for the ``P V`` dot, fp32 accumulation) gives ``lse_i`` (log2 units: ``m + log2(l)`` of the
   scores times ``scale * log2(e)``) and ``delta_i = sum_e dO_ie O_ie`` with ``O`` = the fp32
   accumulator divided by ``l`` (FlashAttention-2's ``D``).
2. :func:`_dkdv_kernel`, one program per (key tile, sequence, kv head): ``P^T = exp2(s^T - lse)``
   recomputed tile by tile over the query tiles at or after the key tile, for each of the kv head's
   ``Q_PER_KV`` query heads in turn (GQA), ``dV += P^T dO``, ``dS^T = P^T (dP^T - delta)`` with
   ``dP^T = V dO^T``, ``dK += dS^T Q``; ``dK`` times ``scale`` at the end.
3. :func:`_dq_kernel`, one program per (query tile, sequence, query head): ``dQ += dS K`` over the
   key tiles up to the diagonal; times ``scale`` at the end.

``P`` and ``dS`` are rounded to the operand dtype before their dots, as in FlashAttention-2 and
Megatron-core's (TransformerEngine's) backward; every dot accumulates in fp32, and the outputs are
fp32 (the caller rounds once).

**Deterministic.** Each output element is written by exactly one program, which sums its terms in a
fixed order (query heads ``0..Q_PER_KV-1``, then tiles in increasing position): no atomics, no
split reductions. Two identical backward passes give the same bits, which ``rl --resume``'s
bitwise continuation needs and which the fused SDPA backward (FlashAttention-2's ``dq`` by atomic
adds; cuDNN's at 3 of 6 sizes tried) did not give: ``benchmarks/results/h200_session29/
sdpa_backward_determinism.md``. A sequence's gradients do not depend on the other sequences of
the pack either (a program reads one sequence only). Tile sizes depend on the head dim only
(64 x 64 tiles, 4 warps up to head dim 64, 8 above; not tuned on the GPU yet).

Shapes: T packed tokens (sequence b is the ``seq_lens[b]`` rows after the earlier ones, of q, k, v, dO),
H query heads, G kv heads (query head h reads kv head ``h // (H // G)``), E head dim.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .._dispatch import host_to_device
from ..triton._common import check_device, next_pow2, round_to, tl_dtype
from ..triton._common import dot_fp32 as _dot

BLOCK_M = 64
"""Query rows per tile (64: the ``wgmma`` row count on Hopper)."""

BLOCK_N = 64
"""Key rows per tile."""

LOG2E = 1.4426950408889634
"""``log2(e)``: scores are kept in log2 units so the kernels use ``exp2``."""


@triton.jit
def _sequence(cu_ptr, b):
    """Sequence b's first row and length, as int64 (element offsets reach past 2^31)."""
    start = tl.load(cu_ptr + b).to(tl.int64)
    return start, tl.load(cu_ptr + b + 1).to(tl.int64) - start


@triton.jit
def _rows(ptr, start, rows, rmask, s_t, head, s_h, cols_e, emask):
    """``[len(rows), BLOCK_E]`` tile: rows ``start + rows`` of head ``head`` (masked entries read 0)."""
    return tl.load(ptr + (start + rows)[:, None] * s_t + head * s_h + cols_e[None, :],
                   mask=rmask[:, None] & emask[None, :], other=0.0)


@triton.jit
def _stats_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, cu_ptr,
                  sq_t, sq_h, sk_t, sk_h, sd_t, sd_h, H, E, scale_log2,
                  Q_PER_KV: tl.constexpr, DTYPE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    pid_m, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, n = _sequence(cu_ptr, b)
    if pid_m * BLOCK_M < n:
        g = h // Q_PER_KV
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols_e = tl.arange(0, BLOCK_E)
        rmask = rows < n
        emask = cols_e < E
        q = _rows(q_ptr, start, rows, rmask, sq_t, h, sq_h, cols_e, emask)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
        hi = tl.minimum((pid_m + 1) * BLOCK_M, n)
        for j0 in range(0, hi, BLOCK_N):
            keys = j0 + tl.arange(0, BLOCK_N)
            kmask = keys < n
            kt = tl.trans(_rows(k_ptr, start, keys, kmask, sk_t, g, sk_h, cols_e, emask))
            s = _dot(q, kt) * scale_log2
            s = tl.where((keys[None, :] <= rows[:, None]) & kmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _rows(v_ptr, start, keys, kmask, sk_t, g, sk_h, cols_e, emask)
            acc = acc * alpha[:, None] + _dot(round_to(p, DTYPE), v)
            m_i = m_new
        l_safe = tl.where(rmask, l_i, 1.0)
        do = _rows(do_ptr, start, rows, rmask, sd_t, h, sd_h, cols_e, emask).to(tl.float32)
        delta = tl.sum(do * (acc / l_safe[:, None]), 1)
        out = (start + rows) * H + h  # [T, H] row-major
        tl.store(lse_ptr + out, m_i + tl.log2(l_safe), mask=rmask)
        tl.store(delta_ptr + out, delta, mask=rmask)


@triton.jit
def _dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, cu_ptr, dk_ptr, dv_ptr,
                 sq_t, sq_h, sk_t, sk_h, sd_t, sd_h, H, G, E, scale, scale_log2,
                 Q_PER_KV: tl.constexpr, DTYPE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    pid_n, b, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, n = _sequence(cu_ptr, b)
    if pid_n * BLOCK_N < n:
        keys = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cols_e = tl.arange(0, BLOCK_E)
        kmask = keys < n
        emask = cols_e < E
        kv_mask = kmask[:, None] & emask[None, :]
        k = _rows(k_ptr, start, keys, kmask, sk_t, g, sk_h, cols_e, emask)
        v = _rows(v_ptr, start, keys, kmask, sk_t, g, sk_h, cols_e, emask)
        dk = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
        lo = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M  # the first query tile reaching this key tile
        for r in range(0, Q_PER_KV):
            h = g * Q_PER_KV + r
            for i0 in range(lo, n, BLOCK_M):
                rows = i0 + tl.arange(0, BLOCK_M)
                rmask = rows < n
                qt = tl.trans(_rows(q_ptr, start, rows, rmask, sq_t, h, sq_h, cols_e, emask))
                lse = tl.load(lse_ptr + (start + rows) * H + h, mask=rmask, other=0.0)
                st = _dot(k, qt) * scale_log2  # [BLOCK_N, BLOCK_M]: s^T
                live = (keys[:, None] <= rows[None, :]) & rmask[None, :] & kmask[:, None]
                pt = tl.where(live, tl.exp2(st - lse[None, :]), 0.0)
                do = _rows(do_ptr, start, rows, rmask, sd_t, h, sd_h, cols_e, emask)
                dv += _dot(round_to(pt, DTYPE), do)
                dpt = _dot(v, tl.trans(do))
                delta = tl.load(delta_ptr + (start + rows) * H + h, mask=rmask, other=0.0)
                dst = pt * (dpt - delta[None, :])
                dk += _dot(round_to(dst, DTYPE), tl.trans(qt))
        out = (start + keys)[:, None] * (G * E) + g * E + cols_e[None, :]
        tl.store(dk_ptr + out, dk * scale, mask=kv_mask)
        tl.store(dv_ptr + out, dv, mask=kv_mask)


@triton.jit
def _dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, cu_ptr, dq_ptr,
               sq_t, sq_h, sk_t, sk_h, sd_t, sd_h, H, E, scale, scale_log2,
               Q_PER_KV: tl.constexpr, DTYPE: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    pid_m, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, n = _sequence(cu_ptr, b)
    if pid_m * BLOCK_M < n:
        g = h // Q_PER_KV
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols_e = tl.arange(0, BLOCK_E)
        rmask = rows < n
        emask = cols_e < E
        qd_mask = rmask[:, None] & emask[None, :]
        q = _rows(q_ptr, start, rows, rmask, sq_t, h, sq_h, cols_e, emask)
        do = _rows(do_ptr, start, rows, rmask, sd_t, h, sd_h, cols_e, emask)
        lse = tl.load(lse_ptr + (start + rows) * H + h, mask=rmask, other=0.0)
        delta = tl.load(delta_ptr + (start + rows) * H + h, mask=rmask, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
        hi = tl.minimum((pid_m + 1) * BLOCK_M, n)
        for j0 in range(0, hi, BLOCK_N):
            keys = j0 + tl.arange(0, BLOCK_N)
            kmask = keys < n
            kt = tl.trans(_rows(k_ptr, start, keys, kmask, sk_t, g, sk_h, cols_e, emask))
            vt = tl.trans(_rows(v_ptr, start, keys, kmask, sk_t, g, sk_h, cols_e, emask))
            s = _dot(q, kt) * scale_log2
            live = (keys[None, :] <= rows[:, None]) & kmask[None, :] & rmask[:, None]
            p = tl.where(live, tl.exp2(s - lse[:, None]), 0.0)
            dp = _dot(do, vt)
            ds = p * (dp - delta[:, None])
            dq += _dot(round_to(ds, DTYPE), tl.trans(kt))
        tl.store(dq_ptr + (start + rows)[:, None] * (H * E) + h * E + cols_e[None, :], dq * scale, mask=qd_mask)


MAX_HEAD_DIM = 128
"""Largest head dim the kernels take (fp32 ``[64, E]`` dK and dV accumulators live in registers)."""


def causal_attention_grads(q_THE: torch.Tensor, k_TGE: torch.Tensor, v_TGE: torch.Tensor, do_THE: torch.Tensor,
                           seq_lens: Sequence[int], scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of causal self-attention ``O = softmax(q k^T * scale) v`` over packed whole
    sequences (query row i of a sequence attends its keys ``0..i``), given ``dO``.

    Args:
        q_THE: ``[T, H, E]`` bf16 or fp16, head dim contiguous, ``E <= 128``; ``k_TGE``, ``v_TGE``:
            ``[T, G, E]`` in q's dtype with the same strides as each other, G dividing H; ``do_THE``:
            ``[T, H, E]`` in q's dtype, head dim contiguous. Any row/head strides (views of a fused
            projection are fine).
        seq_lens: host ints, one per sequence, summing to T: sequence b is the next ``seq_lens[b]``
            rows (queries and keys are the same rows); 0 is allowed.
        scale: the softmax scale (the model's ``1/sqrt(head_dim)`` or its config's value).

    Returns:
        ``dq [T, H, E]``, ``dk [T, G, E]``, ``dv [T, G, E]``, fp32, contiguous (GQA: a kv head's
        gradient sums its query heads in fp32 inside one program).

    Raises:
        ValueError: shapes, dtypes, strides or devices that do not fit (the message names which), H not
            a multiple of G, E above :data:`MAX_HEAD_DIM`, ``seq_lens`` negative or not summing to T, or
            tensors off CUDA without ``TRITON_INTERPRET=1``.
    """
    what = "causal attention gradients"
    if q_THE.dim() != 3 or k_TGE.dim() != 3 or v_TGE.dim() != 3 or do_THE.dim() != 3:
        raise ValueError(f"{what}: q, k, v, dO must be 3-D ([T, H, E] / [T, G, E]); got q {list(q_THE.shape)}, "
                         f"k {list(k_TGE.shape)}, v {list(v_TGE.shape)}, dO {list(do_THE.shape)}")
    t, h, e = q_THE.shape
    g = k_TGE.shape[1]
    if k_TGE.shape != v_TGE.shape or k_TGE.shape[0] != t or k_TGE.shape[2] != e or do_THE.shape != q_THE.shape:
        raise ValueError(f"{what}: q {list(q_THE.shape)}, k {list(k_TGE.shape)}, v {list(v_TGE.shape)}, "
                         f"dO {list(do_THE.shape)}: k and v must be [T, G, E] and dO like q")
    if g < 1 or h % g:
        raise ValueError(f"{what}: q's {h} heads are not a multiple of k/v's {g} heads")
    if e > MAX_HEAD_DIM:
        raise ValueError(f"{what}: head dim {e} above {MAX_HEAD_DIM}")
    dt = q_THE.dtype
    if dt not in (torch.bfloat16, torch.float16) or {k_TGE.dtype, v_TGE.dtype, do_THE.dtype} != {dt}:
        raise ValueError(f"{what}: q/k/v/dO must share one half-precision dtype, got "
                         f"{q_THE.dtype}/{k_TGE.dtype}/{v_TGE.dtype}/{do_THE.dtype}")
    if k_TGE.stride() != v_TGE.stride() or q_THE.stride(2) != 1 or k_TGE.stride(2) != 1 or do_THE.stride(2) != 1:
        raise ValueError(f"{what}: the head dim must be contiguous and k, v share strides")
    lens = [int(n) for n in seq_lens]
    if any(n < 0 for n in lens) or sum(lens) != t:
        raise ValueError(f"{what}: sequence lengths must be >= 0 and sum to T = {t}; got {lens}")
    check_device(what, q_THE, k_TGE, v_TGE, do_THE)
    dev = q_THE.device
    dq = torch.empty((t, h, e), dtype=torch.float32, device=dev)
    dk = torch.empty((t, g, e), dtype=torch.float32, device=dev)
    dv = torch.empty((t, g, e), dtype=torch.float32, device=dev)
    b, max_len = len(lens), max(lens, default=0)
    if t == 0:
        return dq, dk, dv
    cu = host_to_device(torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int64), dev)
    lse = torch.empty((t, h), dtype=torch.float32, device=dev)
    delta = torch.empty((t, h), dtype=torch.float32, device=dev)
    block_e = max(16, next_pow2(e))
    scale_log2 = float(scale) * LOG2E
    common = dict(Q_PER_KV=h // g, DTYPE=tl_dtype(dt), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_E=block_e,
                  num_warps=4 if block_e <= 64 else 8, num_stages=2)
    strides = (q_THE.stride(0), q_THE.stride(1), k_TGE.stride(0), k_TGE.stride(1), do_THE.stride(0),
               do_THE.stride(1))
    m_tiles, n_tiles = triton.cdiv(max_len, BLOCK_M), triton.cdiv(max_len, BLOCK_N)
    _stats_kernel[(m_tiles, b, h)](q_THE, k_TGE, v_TGE, do_THE, lse, delta, cu, *strides, h, e, scale_log2, **common)
    _dkdv_kernel[(n_tiles, b, g)](q_THE, k_TGE, v_TGE, do_THE, lse, delta, cu, dk, dv, *strides, h, g, e,
                                  float(scale), scale_log2, **common)
    _dq_kernel[(m_tiles, b, h)](q_THE, k_TGE, v_TGE, do_THE, lse, delta, cu, dq, *strides, h, e,
                                float(scale), scale_log2, **common)
    return dq, dk, dv


__all__ = ["causal_attention_grads", "BLOCK_M", "BLOCK_N", "MAX_HEAD_DIM"]
