"""Triton kernels of mHC: ``hc_pre``, ``hc_post`` and ``hc_head`` (math: :mod:`unified_models.ops.mhc`).

Shapes: T tokens, n streams, D hidden, K = n D the flattened width, M = (2 + n) n mixing logits
(``hc_head``: M = n); ``NP = next_pow2(n)``, ``MP = next_pow2(M)`` (>= 16).

**Projection** (:func:`_hc_mix_kernel`, shared by ``hc_pre`` and ``hc_head``). The flattened
streams' K axis is cut into ``S = n * cdiv(D, SPLIT_K)`` fixed chunks of ``SPLIT_K`` columns
(never crossing a stream): a function of n and D only, never of T. Program ``(row tile, chunk)``
reads its ``[BLOCK_T, SPLIT_K]`` slice of ``h`` once in fixed ``BLOCK_K`` steps from the chunk's
start and writes two fp32 partials: the raw dot ``sum_k h_k fn[m, k]`` (``[BLOCK_T, MP]``) and the
sum of squares ``sum_k h_k^2``. The GEMM uses tensor cores: bf16 streams are exact bf16 operands
and ``fn`` (fp32) is split exactly into three bf16 pieces ``hi + mid + lo`` (8 + 8 + 8 significand
bits; exact unless ``|fn| < 2^-110``, where ``lo`` would be subnormal), so ``h fn^T = h hi^T + h mid^T + h lo^T`` has exact products and fp32 accumulation (three
bf16 ``tl.dot`` per K step). fp32 streams use IEEE fp32 ``tl.dot`` (no TF32).

**Coefficients and collapse** (:func:`_hc_apply_kernel`). Per ``[BLOCK_T, BLOCK_D]`` output tile
the partials are summed in chunk order ``((0 + p_0) + p_1) + ...`` (fp32), then
``r = 1 / sqrt_rn(sum_sq / K + norm_eps)`` and ``mix = raw * r`` (the unweighted RMS norm applied
after the projection: ``rms(h) fn^T = r (h fn^T)``; transformers normalises first, the same in exact
arithmetic), ``pre = sigmoid(mix scale_0 + base) + hc_eps``, ``post = 2 sigmoid(...)``, ``comb`` =
softmax over each row of the ``n x n`` block, ``+ hc_eps``, then Sinkhorn: columns, then
``sinkhorn_iters - 1`` times rows and columns, each ``/ (sum + hc_eps)``. Every sum over the
stream axis (softmax, Sinkhorn, the collapse) is an explicit left-to-right chain over ``j = 0..n-1``
(each term picked by a masked ``tl.sum`` with one nonzero element, which is exact), the order of
the CPU path's ``sum_chain``; maxima are exact in any order. Divisions are IEEE (``div_rn``);
``sigmoid(z) = div_rn(1, 1 + exp(-z))``. Then ``x = round(sum_j pre_j h_j)`` (fp32 chain, one
rounding to h's dtype). The coefficients of a row tile are recomputed by every ``BLOCK_D`` column
program of that tile (identical arithmetic); column block 0 stores ``post`` and ``comb``.

**Post** (:func:`_hc_post_kernel`): per ``[BLOCK_T, BLOCK_D]`` tile, every ``h_j`` read once,
``acc[k] = ((0 + c_0k h_0) + c_1k h_1) + ...`` with ``c = fp32(round_h(comb))`` (fp32, stream
order), ``out_k = round_h(round_h(round_h(post_k) y) + round_h(acc[k]))``: transformers' rounding
points (``post.to(dtype) * y + matmul(comb.to(dtype)^T, h)``).

Batch invariance: no kernel, tile or chunk depends on T (``T`` is ``do_not_specialize``); a
row's values depend on its own row only; no atomics; fixed reduction orders. On the GPU
``tl.exp`` is the hardware's approximate exponential and fp32 mul + add may contract to FMA
(the same code for every row): other bits than the CPU path, identical for every batch. Under
the interpreter (CPU) the projection's dots are exact fp64 products summed in numpy's fixed order
(:func:`interpreter_dot`), rounded to fp32 once per chunk. Tolerances against the fp64 oracle:
``tests/ops/test_mhc.py`` (``test_triton_*``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton._common import _INTERP, INTERPRET, check_device, interpreter_dot, next_pow2, round_f64_to, round_to

if INTERPRET:
    # Few, big programs (the interpreter pays per program); SPLIT_K small enough that the op
    # tests' D = 80 streams give several chunks per stream (the chunk sum and a masked tail).
    SPLIT_K = 64
    MIX_CONFIG = {torch.bfloat16: (64, 32, 4), torch.float32: (64, 32, 4)}
    APPLY_T, APPLY_D, APPLY_WARPS = 128, 64, 4
    POST_T, POST_D, POST_WARPS = 64, 64, 4
else:
    # Hopper: 64-row wgmma tiles; 16 chunks for D = 4096, n = 4 (K = 16384) so a decode step
    # still spreads over several SMs. Fixed constants, chosen so that ptxas (sm_90a) reports no
    # register spills; not timed on the H200 yet.
    SPLIT_K = 1024
    MIX_CONFIG = {torch.bfloat16: (64, 64, 8), torch.float32: (64, 32, 8)}
    APPLY_T, APPLY_D, APPLY_WARPS = 16, 256, 8
    POST_T, POST_D, POST_WARPS = 8, 128, 4
MIX_T = 64
"""Rows per projection program (every ``MIX_CONFIG`` entry): ``(BLOCK_T, BLOCK_K, num_warps)`` per stream dtype."""
assert all(cfg[0] == MIX_T and SPLIT_K % cfg[1] == 0 for cfg in MIX_CONFIG.values())

_DTYPES = (torch.bfloat16, torch.float32)


def mix_chunks(n: int, d: int) -> int:
    """The number ``S`` of fixed K chunks of the projection: ``n * cdiv(D, SPLIT_K)`` (never depends on T)."""
    return n * triton.cdiv(d, SPLIT_K)


@triton.jit(do_not_specialize=["T"])
def _hc_mix_kernel(h_ptr, fn_ptr, part_ptr, ss_ptr, T, D, M, CHUNKS,
                   stride_ht, stride_hj, stride_hd, stride_fm, stride_fk,
                   SPLIT_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, MP: tl.constexpr,
                   BF16_SPLIT: tl.constexpr):
    """Partials of chunk ``s``: ``part[s, t, m] = sum_k h[t, k] fn[m, k]``, ``ss[s, t] = sum_k h[t, k]^2``."""
    pid_t = tl.program_id(0)
    s = tl.program_id(1)
    j = s // CHUNKS
    d_start = (s % CHUNKS) * SPLIT_K
    offs_t = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    offs_m = tl.arange(0, MP)
    mask_m = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    h_row = h_ptr + offs_t[:, None] * stride_ht + j.to(tl.int64) * stride_hj
    fn_col = fn_ptr + offs_m[None, :] * stride_fm + (j.to(tl.int64) * D) * stride_fk
    ss = tl.zeros((BLOCK_T,), dtype=tl.float32)
    if _INTERP:
        acc64 = tl.zeros((BLOCK_T, MP), dtype=tl.float64)
    else:
        acc = tl.zeros((BLOCK_T, MP), dtype=tl.float32)
    for k0 in range(0, SPLIT_K, BLOCK_K):
        d = d_start + k0 + offs_k
        mask_k = d < D
        a = tl.load(h_row + d[None, :] * stride_hd, mask=mask_t[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(fn_col + d[:, None] * stride_fk, mask=mask_k[:, None] & mask_m[None, :], other=0.0)
        w = w.to(tl.float32)
        af = a.to(tl.float32)
        ss += tl.sum(af * af, axis=1)
        if _INTERP:
            acc64 += interpreter_dot(af, w)
        elif BF16_SPLIT:
            hi = w.to(tl.bfloat16)
            r1 = w - hi.to(tl.float32)
            mid = r1.to(tl.bfloat16)
            lo = (r1 - mid.to(tl.float32)).to(tl.bfloat16)
            acc = tl.dot(a, lo, acc)
            acc = tl.dot(a, mid, acc)
            acc = tl.dot(a, hi, acc)
        else:
            acc = tl.dot(af, w, acc, input_precision="ieee")
    if _INTERP:
        acc = round_f64_to(acc64, tl.float32)
    base = s.to(tl.int64) * T
    tl.store(part_ptr + (base + offs_t)[:, None] * MP + offs_m[None, :], acc, mask=mask_t[:, None])
    tl.store(ss_ptr + base + offs_t, ss, mask=mask_t)


@triton.jit
def _sum_parts(part_ptr, S, T, offs, mask, MP: tl.constexpr):
    """``((0 + p_0) + p_1) + ... + p_{S-1}`` of the partials at ``offs = t * MP + m`` (int64, any shape)."""
    acc = tl.zeros(offs.shape, dtype=tl.float32)
    for s in range(S):
        acc = acc + tl.load(part_ptr + (s * T).to(tl.int64) * MP + offs, mask=mask, other=0.0)
    return acc


@triton.jit
def _pick(x, idx, j: tl.constexpr, axis: tl.constexpr):
    """``x`` at ``idx == j`` along ``axis`` (a masked ``tl.sum`` with one nonzero term: exact)."""
    return tl.sum(tl.where(idx == j, x, 0.0), axis=axis)


@triton.jit
def _chain_sum(x, idx, N: tl.constexpr, axis: tl.constexpr):
    """``((x_0 + x_1) + ...) + x_{N-1}`` along ``axis`` (``idx`` the broadcast index of that axis)."""
    acc = _pick(x, idx, 0, axis)
    for j in tl.static_range(1, N):
        acc = acc + _pick(x, idx, j, axis)
    return acc


@triton.jit
def _den(s, idx, N: tl.constexpr, eps):
    """``s + eps`` where ``idx < N``, 1 in the padding lanes (so they divide 0 by 1, never 0 by 0)."""
    return tl.where(idx < N, s + eps, 1.0)


@triton.jit
def _sigmoid(z):
    return tl.math.div_rn(1.0, 1.0 + tl.exp(-z))


@triton.jit(do_not_specialize=["T"])
def _hc_apply_kernel(h_ptr, part_ptr, ss_ptr, base_ptr, scale_ptr, x_ptr, post_ptr, comb_ptr,
                     T, D, S, K_f, norm_eps, hc_eps, iters,
                     stride_ht, stride_hj, stride_hd, stride_xt, stride_xd,
                     N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr, HEAD: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_t = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    # the unweighted RMS norm's factor from the sums of squares (chunk order)
    ss = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for s in range(S):
        ss = ss + tl.load(ss_ptr + s * T + offs_t, mask=mask_t, other=0.0)
    r = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(ss, K_f) + norm_eps))
    jn = tl.arange(0, NP)
    mask_j = jn < N
    mask_tj = mask_t[:, None] & mask_j[None, :]
    t2 = offs_t[:, None]
    mix_pre = _sum_parts(part_ptr, S, T, t2 * MP + jn[None, :], mask_tj, MP) * r[:, None]
    pre = _sigmoid(mix_pre * tl.load(scale_ptr) + tl.load(base_ptr + jn, mask=mask_j, other=0.0)[None, :]) + hc_eps
    pre = tl.where(mask_tj, pre, 0.0)
    if not HEAD:
        if pid_d == 0:
            mix_post = _sum_parts(part_ptr, S, T, t2 * MP + N + jn[None, :], mask_tj, MP) * r[:, None]
            post = 2.0 * _sigmoid(mix_post * tl.load(scale_ptr + 1)
                                  + tl.load(base_ptr + N + jn, mask=mask_j, other=0.0)[None, :])
            tl.store(post_ptr + t2 * N + jn[None, :], post, mask=mask_tj)
            # comb [BLOCK_T, NP (j), NP (k)]: logits m = 2n + j n + k
            jj = jn[None, :, None]
            kk = jn[None, None, :]
            valid = (jj < N) & (kk < N)
            t3 = offs_t[:, None, None]
            mask3 = mask_t[:, None, None] & valid
            cm = 2 * N + jj * N + kk
            logits = _sum_parts(part_ptr, S, T, t3 * MP + cm, mask3, MP) * r[:, None, None]
            logits = logits * tl.load(scale_ptr + 2) + tl.load(base_ptr + cm, mask=valid, other=0.0)
            logits = tl.where(kk < N, logits, float("-inf"))  # rows j >= n stay finite (0 / -inf)
            mx = tl.max(logits, axis=2)
            ex = tl.where(valid, tl.exp(logits - mx[:, :, None]), 0.0)
            j2 = jn[None, :]
            comb = tl.math.div_rn(ex, _den(_chain_sum(ex, kk, N, 2), j2, N, 0.0)[:, :, None])
            comb = tl.where(valid, comb + hc_eps, 0.0)
            comb = tl.math.div_rn(comb, _den(_chain_sum(comb, jj, N, 1), j2, N, hc_eps)[:, None, :])
            for _ in range(iters - 1):
                comb = tl.math.div_rn(comb, _den(_chain_sum(comb, kk, N, 2), j2, N, hc_eps)[:, :, None])
                comb = tl.math.div_rn(comb, _den(_chain_sum(comb, jj, N, 1), j2, N, hc_eps)[:, None, :])
            tl.store(comb_ptr + t3 * (N * N) + jj * N + kk, comb, mask=mask3)
    # the collapse: x = round(sum_j pre_j h_j), fp32 chain in stream order
    offs_d = pid_d.to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = mask_t[:, None] & (offs_d < D)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(N):
        pj = _pick(pre, jn[None, :], j, 1)
        hj = tl.load(h_ptr + t2 * stride_ht + j * stride_hj + offs_d[None, :] * stride_hd, mask=mask, other=0.0)
        acc = acc + pj[:, None] * hj.to(tl.float32)
    tl.store(x_ptr + t2 * stride_xt + offs_d[None, :] * stride_xd, round_to(acc, x_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["T"])
def _hc_post_kernel(h_ptr, y_ptr, post_ptr, comb_ptr, out_ptr, T, D,
                    stride_ht, stride_hj, stride_hd, stride_yt, stride_yd, stride_pt, stride_pj,
                    stride_ct, stride_cj, stride_ck, stride_ot, stride_oj, stride_od,
                    N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_t = offs_t < T
    mask_td = mask_t[:, None] & (offs_d < D)[None, :]
    kn = tl.arange(0, NP)
    mask_tk = mask_t[:, None] & (kn < N)[None, :]
    dt = out_ptr.dtype.element_ty
    t2 = offs_t[:, None]
    acc = tl.zeros((BLOCK_T, NP, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(N):
        c = tl.load(comb_ptr + t2 * stride_ct + j * stride_cj + kn[None, :] * stride_ck, mask=mask_tk, other=0.0)
        c = round_to(c.to(tl.float32), dt).to(tl.float32)
        hj = tl.load(h_ptr + t2 * stride_ht + j * stride_hj + offs_d[None, :] * stride_hd, mask=mask_td, other=0.0)
        acc = acc + c[:, :, None] * hj.to(tl.float32)[:, None, :]
    p = round_to(tl.load(post_ptr + t2 * stride_pt + kn[None, :] * stride_pj, mask=mask_tk,
                         other=0.0).to(tl.float32), dt).to(tl.float32)
    y = tl.load(y_ptr + t2 * stride_yt + offs_d[None, :] * stride_yd, mask=mask_td, other=0.0).to(tl.float32)
    expand = round_to(p[:, :, None] * y[:, None, :], dt).to(tl.float32)
    out = round_to(expand + round_to(acc, dt).to(tl.float32), dt)
    o_ptrs = out_ptr + offs_t[:, None, None] * stride_ot + kn[None, :, None] * stride_oj + offs_d[None, None, :] * stride_od
    tl.store(o_ptrs, out, mask=mask_td[:, None, :] & (kn < N)[None, :, None])


def _check(op: str, streams_TND: torch.Tensor, *tensors: torch.Tensor) -> None:
    if streams_TND.dtype not in _DTYPES:
        raise ValueError(f"{op}: the Triton kernel takes bf16 or fp32 streams, got {streams_TND.dtype}")
    if streams_TND.shape[2] == 0:
        raise ValueError(f"{op}: the streams have hidden size 0")
    check_device(op, streams_TND, *tensors)


def _mixes(streams_TND, fn_MK):
    """Launch the projection: fp32 partials ``[S, T, MP]`` and sums of squares ``[S, T]``."""
    T, n, D = streams_TND.shape
    M = fn_MK.shape[0]
    mp = max(16, next_pow2(M))
    chunks = triton.cdiv(D, SPLIT_K)
    S = mix_chunks(n, D)
    part = torch.empty(S, T, mp, dtype=torch.float32, device=streams_TND.device)
    ss = torch.empty(S, T, dtype=torch.float32, device=streams_TND.device)
    h = streams_TND
    bt, bk, warps = MIX_CONFIG[h.dtype]
    _hc_mix_kernel[(triton.cdiv(T, bt), S)](
        h, fn_MK, part, ss, T, D, M, chunks, h.stride(0), h.stride(1), h.stride(2), fn_MK.stride(0), fn_MK.stride(1),
        SPLIT_K=SPLIT_K, BLOCK_T=bt, BLOCK_K=bk, MP=mp, BF16_SPLIT=h.dtype == torch.bfloat16, num_warps=warps)
    return part, ss, S, mp


def _apply(streams_TND, part, ss, S, mp, base_M, scale, norm_eps, hc_eps, iters, head):
    T, n, D = streams_TND.shape
    dev = streams_TND.device
    x = torch.empty(T, D, dtype=streams_TND.dtype, device=dev)
    if head:  # no post / comb (the kernel never touches them)
        post = comb = part
    else:
        post = torch.empty(T, n, dtype=torch.float32, device=dev)
        comb = torch.empty(T, n, n, dtype=torch.float32, device=dev)
    h = streams_TND
    _hc_apply_kernel[(triton.cdiv(T, APPLY_T), triton.cdiv(D, APPLY_D))](
        h, part, ss, base_M.float().contiguous(), scale.float().contiguous(), x, post, comb,
        T, D, S, float(n * D), float(norm_eps), float(hc_eps), int(iters),
        h.stride(0), h.stride(1), h.stride(2), x.stride(0), x.stride(1),
        N=n, NP=next_pow2(n), MP=mp, HEAD=head, BLOCK_T=APPLY_T, BLOCK_D=APPLY_D, num_warps=APPLY_WARPS)
    return x, post, comb


def hc_pre_triton(streams_TND: torch.Tensor, fn_MK: torch.Tensor, base_M: torch.Tensor, scale_3: torch.Tensor,
                  norm_eps: float, hc_eps: float, sinkhorn_iters: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HC pre on the GPU (module doc): ``(x [T, D] in h's dtype, post [T, n] fp32, comb [T, n, n] fp32)``.

    Args:
        streams_TND: ``[T, n, D]`` bf16/fp32 streams (any strides); fn_MK: ``[(2+n)n, nD]`` (used in
            fp32); base_M: ``[M]``; scale_3: ``[3]``; norm_eps, hc_eps, sinkhorn_iters as
            :func:`unified_models.ops.mhc.hc_pre` (shapes checked there).

    Raises:
        ValueError: streams not bf16/fp32 or of hidden size 0, tensors on different devices.
    """
    _check("hc_pre_triton", streams_TND, fn_MK, base_M, scale_3)
    T, n, D = streams_TND.shape
    if T == 0:
        dev = streams_TND.device
        return (torch.empty(0, D, dtype=streams_TND.dtype, device=dev), torch.empty(0, n, device=dev),
                torch.empty(0, n, n, device=dev))
    part, ss, S, mp = _mixes(streams_TND, fn_MK)
    return _apply(streams_TND, part, ss, S, mp, base_M, scale_3, norm_eps, hc_eps, sinkhorn_iters, False)


def hc_head_triton(streams_TND: torch.Tensor, fn_NK: torch.Tensor, base_N: torch.Tensor, scale_1: torch.Tensor,
                   norm_eps: float, hc_eps: float) -> torch.Tensor:
    """hc_head on the GPU: ``round(sum_j (sigmoid(mix_j scale + base_j) + hc_eps) h_j)`` ``[T, D]`` (module doc).

    Raises:
        ValueError: streams not bf16/fp32 or of hidden size 0, tensors on different devices.
    """
    _check("hc_head_triton", streams_TND, fn_NK, base_N, scale_1)
    T, n, D = streams_TND.shape
    if T == 0:
        return torch.empty(T, D, dtype=streams_TND.dtype, device=streams_TND.device)
    part, ss, S, mp = _mixes(streams_TND, fn_NK)
    return _apply(streams_TND, part, ss, S, mp, base_N, scale_1, norm_eps, hc_eps, 1, True)[0]


def hc_post_triton(streams_TND: torch.Tensor, y_TD: torch.Tensor, post_TN: torch.Tensor,
                   comb_TNN: torch.Tensor) -> torch.Tensor:
    """HC post on the GPU: ``round(round(round(post_k) y) + round(sum_j round(comb[j, k]) h_j))`` ``[T, n, D]``.

    Args:
        streams_TND: ``[T, n, D]`` bf16/fp32; y_TD: ``[T, D]`` same dtype; post_TN ``[T, n]``,
            comb_TNN ``[T, n, n]`` (any float dtype, rounded to h's dtype first). Shapes checked by
            :func:`unified_models.ops.mhc.hc_post`.

    Raises:
        ValueError: streams not bf16/fp32 or of hidden size 0, tensors on different devices.
    """
    _check("hc_post_triton", streams_TND, y_TD, post_TN, comb_TNN)
    T, n, D = streams_TND.shape
    out = torch.empty(T, n, D, dtype=streams_TND.dtype, device=streams_TND.device)
    if T == 0 or D == 0:
        return out
    h, y, p, c = streams_TND, y_TD, post_TN, comb_TNN
    _hc_post_kernel[(triton.cdiv(T, POST_T), triton.cdiv(D, POST_D))](
        h, y, p, c, out, T, D, h.stride(0), h.stride(1), h.stride(2), y.stride(0), y.stride(1),
        p.stride(0), p.stride(1), c.stride(0), c.stride(1), c.stride(2), out.stride(0), out.stride(1), out.stride(2),
        N=n, NP=next_pow2(n), BLOCK_T=POST_T, BLOCK_D=POST_D, num_warps=POST_WARPS)
    return out
