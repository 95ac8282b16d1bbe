"""Mamba-2 kernels in Triton: causal conv1d, dt, the SSD chunked scan, gated RMSNorm.

Math, state layout and batch layout: :mod:`unified_models.ops.mamba2`. Every
kernel has fixed tiles (per device, never per batch), no autotuning, no
atomics, and no program per token:

* conv1d: one program per (tile of ``BLOCK_T`` tokens, ``BLOCK_C`` channels);
  each row gathers its own W inputs (batch rows, or the conv state for
  positions before the batch), taps added in order w = 0..W-1.
* dt: tiles of ``BLOCK_T`` tokens x all heads, elementwise.
* SSD, three kernels over chunk items (a chunk of Q rows of one sequence,
  aligned at an absolute position), as in mamba_ssm's chunk_cumsum /
  chunk_state + state_passing / chunk_scan:
    1. ``_ssd_cumsum_kernel`` per (item, head): ``A_cum`` of the chunk's rows;
    2. ``_ssd_state_kernel`` per (sequence, head, P block): walks the
       sequence's complete chunks in order; chunk state as one dot
       ``(x * w)^T [P, Q] @ B [Q, N]``, then ``S = exp(A_cum[Q-1]) S + cs``;
    3. ``_ssd_scan_kernel`` per (item, head, block of ``BLOCK_L`` rows): the
       rows' outputs from the chunk's start state and the source blocks
       ``0..own block`` (rows past a query are masked to exact zeros).
  A row's bits depend only on its chunk's rows up to itself and the start
  state, with tile shapes fixed by Q, P, N: decode (one row), chunked prefill
  and full prefill give the same bits. Rows of an item that come from before
  this batch are read from the state's pending rows.
* gated RMSNorm: one program per (tile of ``BLOCK_T`` tokens, group); each row
  reduced on its own.

Dots: under the interpreter :func:`interpreter_dot` (exact fp64 products in
numpy's fixed order, no BLAS); on GPU ``tl.dot`` on the model dtype (fp32
operands: IEEE fp32), fp32 accumulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton._common import _INTERP, FLOAT_DTYPES, INTERPRET, check_device, interpreter_dot, next_pow2, round_to, tl_dtype

if INTERPRET:
    # Small tiles so that test chunks still span several row blocks.
    BLOCK_L = 4
    BLOCK_PS = 16
    CONV_BLOCK_T, CONV_BLOCK_C = 16, 64
    NORM_BLOCK_T = 16
    NUM_WARPS, NUM_STAGES = 4, 1
    SSD_NUM_WARPS = 4
else:
    BLOCK_L = 64
    BLOCK_PS = 64
    CONV_BLOCK_T, CONV_BLOCK_C = 16, 128
    NORM_BLOCK_T = 8
    NUM_WARPS, NUM_STAGES = 4, 2
    SSD_NUM_WARPS = 8  # [64 x 128] operand tiles per program

SCAN_LAUNCH = ({"block_l": BLOCK_L, "num_warps": SSD_NUM_WARPS, "num_stages": NUM_STAGES} if INTERPRET
               else {"block_l": 64, "num_warps": 4, "num_stages": 1})
"""Row block and launch of ``_ssd_scan_kernel`` on prefill, chunked prefill and mixed steps. Picked
on the H200 by ``benchmarks/mamba_prefill.py --scan-candidates`` (session 26,
``benchmarks/results/h200_session26/mamba_prefill.json``, Nano widths, one layer's dt + SSD): 64 rows
x 4 warps x 1 stage took 1.307 ms on 8 x 2,048 tokens and 1.493 ms on 64 x 256 against 2.236 / 2.460
ms for the earlier 64 x 8 x 2 (native ``mamba_chunk_scan_combined_varlen``: 0.955 / 0.793 ms), with
the same bits (scan output, chunk states, committed slots). Not every launch keeps them: 32 rows x
8 warps x 2 stages changed the scan output there, so a launch is only taken after that comparison."""

DECODE_SCAN_LAUNCH = dict(SCAN_LAUNCH) if INTERPRET else {"block_l": 16, "num_warps": 4, "num_stages": 1}
"""Row block and launch of ``_ssd_scan_kernel`` on a decode step (``meta.uniform_decode``). A
decode step launches one program per (sequence, head) for the row block that holds its token.
A row's value depends on the K order of its dots (source rows in blocks from row 0, in steps of
16 on tensor cores; rows past the token are exact zeros) and not on how many rows or warps a
program holds, so the candidates of ``benchmarks/decode_chunk_position.py --scan-candidates``
are kept only where the H200 gives the general chunked scan's bits for every position. Session 25
(``benchmarks/results/h200_session25/dcp_candidates.json``, Nano widths): every candidate from
64 x 8 x 2 down to 16 x 2 x 1 gave those bits at B = 64 and 256, p = 0, 64, 127; 16 rows x 4 warps
x 1 stage took 0.539 / 0.775 ms at B = 256, p = 0 / 64, against 1.762 / 2.422 ms for the general
scan's 64 x 8 x 2 (native ``selective_state_update``: 0.276 ms)."""

STATE_LAUNCH = {"block_p": BLOCK_PS, "num_warps": SSD_NUM_WARPS, "num_stages": NUM_STAGES}
"""Head-dim block (``x`` columns per program) and launch of ``_ssd_state_kernel``: the chunk
states of prefill, chunked prefill and mixed steps, and a decode step's COMMIT (chunks longer than
128 rows take at most :data:`STATE_STAGES_LONG_CHUNK` stages). A state element ``[p, n]`` is one
dot over the chunk's rows in a fixed order; the head-dim block only decides which program holds
column ``p``. ``benchmarks/mamba_prefill.py --state-candidates`` times candidates and compares
their bits with this launch's."""

STATE_STAGES_LONG_CHUNK = 1
"""Pipeline stages of the chunk-state kernel for chunks longer than 128 rows. With 2 stages a
256-row chunk asked for 298,004 bytes of shared memory on the H200 (limit 232,448; session 23,
``benchmarks/decode_chunk_position.py --chunk 256``); stages change only how loads overlap, never
the values or the order of a sum. With 1 stage the 256-row chunk runs on the H200 and its decode
steps equal the general chunked scan bit for bit (session 24, ``benchmarks/RESULTS.md``)."""

_MIN_DOT = 1 if INTERPRET else 16
"""Smallest tile dim fed to ``tl.dot`` (16 on tensor cores)."""


# --------------------------------------------------------------------------- helpers


@triton.jit
def _mm(a, b, FP32_DOT: tl.constexpr, OP: tl.constexpr):
    """``a @ b`` in fp32 on GPU: IEEE fp32 for fp32 models, else tensor cores on ``OP`` operands.
    (Under the interpreter the kernels call :func:`interpreter_dot` inline: each nested jit
    call costs the interpreter milliseconds.)"""
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(OP), b.to(OP))


# --------------------------------------------------------------------------- conv1d


@triton.jit
def _conv_kernel(x_ptr, w_ptr, bias_ptr, st_ptr, out_ptr, tseq_ptr, tpos_ptr, p0_ptr, slot_ptr,
                 T, C, stride_xt, stride_xc, stride_wc, stride_ww, stride_ss, stride_sk, stride_sc,
                 stride_ot, stride_oc,
                 W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    # Every per-token quantity is a [BLOCK_T, 1] column and every per-channel one a
    # [1, BLOCK_C] row (no 1-D tensors broadcast into two tile layouts): Triton 3.6's
    # layout pass (TritonGPURemoveLayoutConversions) crashed on the 1-D form under
    # vLLM's strides (H200). Index clamps are multiplications, not selects.
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)[:, None]
    c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)[None, :]
    tm = t < T
    cm = c < C
    seq = tl.load(tseq_ptr + t, mask=tm, other=-1).to(tl.int64)
    valid = seq >= 0
    sq = seq * valid.to(tl.int64)
    pos = tl.load(tpos_ptr + t, mask=tm, other=0).to(tl.int64)
    p0 = tl.load(p0_ptr + sq, mask=valid, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + sq, mask=valid, other=0).to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(W):
        q = pos - (W - 1) + j
        fb = valid & (q >= p0)
        rb = (t - (W - 1) + j) * fb.to(tl.int64)
        xv = tl.load(x_ptr + rb * stride_xt + c * stride_xc, mask=fb & cm, other=0.0).to(tl.float32)
        if HAS_STATE:
            # Exactly one of the two masked loads is live for a row (or neither): their
            # sum is that value (x + 0.0; a -0.0 input becomes +0.0 on every path alike).
            fs = valid & (q < p0) & (q >= 0)
            rs = ((W - 1) + q - p0) * fs.to(tl.int64)
            sv = tl.load(st_ptr + slot * stride_ss + rs * stride_sk + c * stride_sc,
                         mask=fs & cm, other=0.0).to(tl.float32)
            xv = xv + sv
        wv = tl.load(w_ptr + c * stride_wc + j * stride_ww, mask=cm, other=0.0).to(tl.float32)
        if j == 0:
            acc = xv * wv
        else:
            acc = acc + xv * wv
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + c, mask=cm, other=0.0).to(tl.float32)
    y = tl.where(valid, acc * tl.sigmoid(acc), 0.0)  # padding rows: +0.0, written here (no zero-filled output)
    tl.store(out_ptr + t * stride_ot + c * stride_oc, round_to(y, out_ptr.dtype.element_ty), mask=tm & cm)


def causal_conv1d_triton(x_TC, weight_CW, bias_C, meta, state) -> torch.Tensor:
    """Kernel of :func:`unified_models.ops.mamba2.causal_conv1d` (without the state write).

    Returns ``[T, C]`` in ``x_TC.dtype``, padding rows 0.
    """
    if x_TC.dtype not in FLOAT_DTYPES or weight_CW.dtype not in FLOAT_DTYPES:
        raise ValueError(f"causal_conv1d_triton: dtypes {x_TC.dtype}/{weight_CW.dtype} must be bf16/fp16/fp32")
    T, C = x_TC.shape
    W = weight_CW.shape[1]
    st = state.conv if state is not None else x_TC
    check_device("causal_conv1d_triton", x_TC, weight_CW, bias_C, st)
    out = torch.empty((T, C), dtype=x_TC.dtype, device=x_TC.device)  # the kernel writes every row
    if T == 0:
        return out
    s_strides = (st.stride(0), st.stride(1), st.stride(2)) if state is not None else (0, 0, 0)
    grid = (triton.cdiv(T, CONV_BLOCK_T), triton.cdiv(C, CONV_BLOCK_C))
    _conv_kernel[grid](
        x_TC, weight_CW, bias_C if bias_C is not None else weight_CW, st, out,
        meta.token_seq, meta.token_pos, meta.start_pos, meta.slot,
        T, C, *x_TC.stride(), *weight_CW.stride(), *s_strides, *out.stride(),
        W=W, HAS_BIAS=bias_C is not None, HAS_STATE=state is not None,
        BLOCK_T=CONV_BLOCK_T, BLOCK_C=CONV_BLOCK_C, num_warps=NUM_WARPS)
    return out


# --------------------------------------------------------------------------- dt


@triton.jit
def _dt_kernel(dt_ptr, bias_ptr, out_ptr, T, H, stride_t, stride_h, lo, hi,
               BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    m = (t[:, None] < T) & (h[None, :] < H)
    v = tl.load(dt_ptr + t[:, None] * stride_t + h[None, :] * stride_h, mask=m, other=0.0).to(tl.float32)
    v = v + tl.load(bias_ptr + h, mask=h < H, other=0.0).to(tl.float32)[None, :]
    # softplus(v) = log1p(exp(v)) for v <= 20 (else v); log1p(e) = log(u) * e / (u - 1), u = 1 + e
    # (Goldberg's accurate log1p from log, tl has no log1p).
    e = tl.exp(tl.minimum(v, 20.0))
    u = 1.0 + e
    d = u - 1.0
    lp = tl.where(d == 0.0, e, tl.log(u) * (e / tl.where(d == 0.0, 1.0, d)))
    sp = tl.where(v <= 20.0, lp, v)
    sp = tl.minimum(tl.maximum(sp, lo), hi)
    tl.store(out_ptr + t[:, None] * H + h[None, :], sp, mask=m)


def mamba2_dt_triton(dt_TH, dt_bias_H, lo: float, hi: float) -> torch.Tensor:
    """Kernel of :func:`unified_models.ops.mamba2.mamba2_dt`: fp32 ``[T, H]``."""
    if dt_TH.dtype not in FLOAT_DTYPES:
        raise ValueError(f"mamba2_dt_triton: dtype {dt_TH.dtype} must be bf16/fp16/fp32")
    check_device("mamba2_dt_triton", dt_TH, dt_bias_H)
    T, H = dt_TH.shape
    out = torch.empty((T, H), dtype=torch.float32, device=dt_TH.device)
    if T == 0:
        return out
    _dt_kernel[(triton.cdiv(T, 64),)](dt_TH, dt_bias_H, out, T, H, *dt_TH.stride(), float(lo), float(hi),
                                       BLOCK_T=64, BLOCK_H=next_pow2(H), num_warps=4)
    return out


# --------------------------------------------------------------------------- gated RMSNorm


@triton.jit
def _gated_norm_kernel(y_ptr, z_ptr, w_ptr, out_ptr, T, GS, eps,
                       stride_yt, stride_yf, stride_zt, stride_zf, stride_ot, stride_of,
                       BLOCK_T: tl.constexpr, BLOCK_GS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    j = tl.arange(0, BLOCK_GS)
    col = g * GS + j
    m = (t[:, None] < T) & (j[None, :] < GS)
    y = tl.load(y_ptr + t[:, None] * stride_yt + col[None, :] * stride_yf, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + t[:, None] * stride_zt + col[None, :] * stride_zf, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + col, mask=j < GS, other=0.0).to(tl.float32)
    hh = y * (z * tl.sigmoid(z))
    ms = tl.sum(hh * hh, axis=1) / GS
    r = tl.rsqrt(ms + eps)
    o = hh * r[:, None] * w[None, :]
    tl.store(out_ptr + t[:, None] * stride_ot + col[None, :] * stride_of, round_to(o, out_ptr.dtype.element_ty), mask=m)


def gated_rms_norm_triton(y_TF, z_TF, weight_F, group_size: int, eps: float, out_dtype) -> torch.Tensor:
    """Kernel of :func:`unified_models.ops.mamba2.gated_rms_norm`."""
    for name, t_ in (("y", y_TF), ("z", z_TF), ("weight", weight_F)):
        if t_.dtype not in FLOAT_DTYPES:
            raise ValueError(f"gated_rms_norm_triton: {name} dtype {t_.dtype} must be bf16/fp16/fp32")
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"gated_rms_norm_triton: out_dtype {out_dtype} must be bf16/fp16/fp32")
    check_device("gated_rms_norm_triton", y_TF, z_TF, weight_F)
    T, F_ = y_TF.shape
    out = torch.empty((T, F_), dtype=out_dtype, device=y_TF.device)
    if T == 0:
        return out
    ng = F_ // group_size
    _gated_norm_kernel[(triton.cdiv(T, NORM_BLOCK_T), ng)](
        y_TF, z_TF, weight_F.contiguous(), out, T, group_size, float(eps),
        *y_TF.stride(), *z_TF.stride(), *out.stride(),
        BLOCK_T=NORM_BLOCK_T, BLOCK_GS=next_pow2(group_size), num_warps=NUM_WARPS)
    return out


# --------------------------------------------------------------------------- SSD


@triton.jit
def _ssd_cumsum_kernel(dt_ptr, pdt_ptr, alog_ptr, acum_ptr,
                       item_seq_ptr, item_chunk_ptr, cu_ptr, p0_ptr, len_ptr, slot_ptr,
                       H, stride_dt_t, stride_dt_h, stride_pdt_s, stride_pdt_r, stride_pdt_h,
                       Q: tl.constexpr, HAS_STATE: tl.constexpr):
    u = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    b = tl.load(item_seq_ptr + u).to(tl.int64)
    k = tl.load(item_chunk_ptr + u).to(tl.int64)
    p0 = tl.load(p0_ptr + b).to(tl.int64)
    L = tl.load(len_ptr + b).to(tl.int64)
    c0 = tl.load(cu_ptr + b).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    l = tl.arange(0, Q).to(tl.int64)
    q = k * Q + l
    fb = (q >= p0) & (q < p0 + L)
    fp = q < p0
    rb = (c0 + q - p0) * fb.to(tl.int64)
    rp = l * fp.to(tl.int64)
    dt = tl.load(dt_ptr + h * stride_dt_h + rb * stride_dt_t, mask=fb, other=0.0).to(tl.float32)
    if HAS_STATE:
        dtp = tl.load(pdt_ptr + h * stride_pdt_h + slot * stride_pdt_s + rp * stride_pdt_r, mask=fp, other=0.0)
        dt = tl.where(fp, dtp.to(tl.float32), dt)
    A = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    acum = tl.cumsum(dt * A, axis=0)
    tl.store(acum_ptr + (u * H + h) * Q + l, acum)


@triton.jit
def _ssd_state_kernel(x_ptr, px_ptr, dt_ptr, pdt_ptr, b_ptr, pb_ptr, acum_ptr, ssm_ptr, ent_ptr,
                      sseq_ptr, seq_item_ptr, seq_ent_ptr, item_chunk_ptr, cu_ptr, p0_ptr, len_ptr, slot_ptr,
                      H, P, N, HPG,
                      stride_xt, stride_xh, stride_xp, stride_pxs, stride_pxr, stride_pxh, stride_pxp,
                      stride_dt_t, stride_dt_h, stride_pdt_s, stride_pdt_r, stride_pdt_h,
                      stride_bt, stride_bg, stride_bn, stride_pbs, stride_pbr, stride_pbg, stride_pbn,
                      stride_ss, stride_sh, stride_sp, stride_sn,
                      Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                      HAS_STATE: tl.constexpr, FP32_DOT: tl.constexpr, OP: tl.constexpr,
                      COMMIT: tl.constexpr = False):
    # COMMIT (decode steps, ops.mamba2.decode): the state after the sequence's complete chunk
    # goes straight into its slot (ssm), not into the entries; nothing is read or written
    # for a sequence without one.
    b = tl.load(sseq_ptr + tl.program_id(0)).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    p = tl.program_id(2).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P).to(tl.int64)
    n = tl.arange(0, BLOCK_N).to(tl.int64)
    pm = p < P
    nm = n < N
    g = h // HPG
    p0 = tl.load(p0_ptr + b).to(tl.int64)
    L = tl.load(len_ptr + b).to(tl.int64)
    c0 = tl.load(cu_ptr + b).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    u0 = tl.load(seq_item_ptr + b).to(tl.int64)
    e0 = tl.load(seq_ent_ptr + b).to(tl.int64)
    ne = (tl.load(seq_ent_ptr + b + 1) - tl.load(seq_ent_ptr + b)).to(tl.int32)
    smask = pm[:, None] & nm[None, :]
    S = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    if HAS_STATE:
        lim = tl.where(p0 >= Q, P, 0)  # the boundary state is 0 before the first boundary
        if COMMIT:
            lim = tl.where(ne > 0, lim, 0)
        S = tl.load(ssm_ptr + slot * stride_ss + h * stride_sh + p[:, None] * stride_sp + n[None, :] * stride_sn,
                    mask=(p[:, None] < lim) & nm[None, :], other=0.0)
    l = tl.arange(0, Q).to(tl.int64)
    for j in range(0, ne):
        u = u0 + j
        k = tl.load(item_chunk_ptr + u).to(tl.int64)
        q = k * Q + l
        fb = (q >= p0) & (q < p0 + L)
        fp = q < p0
        rb = (c0 + q - p0) * fb.to(tl.int64)
        rp = l * fp.to(tl.int64)
        # rows of the chunk: batch rows (fb), pending rows of the slot (fp), else 0
        X = tl.load(x_ptr + h * stride_xh + rb[:, None] * stride_xt + p[None, :] * stride_xp,
                    mask=fb[:, None] & pm[None, :], other=0.0).to(tl.float32)  # [Q, BP]
        Bm = tl.load(b_ptr + g * stride_bg + rb[:, None] * stride_bt + n[None, :] * stride_bn,
                     mask=fb[:, None] & nm[None, :], other=0.0).to(tl.float32)  # [Q, BN]
        dt = tl.load(dt_ptr + h * stride_dt_h + rb * stride_dt_t, mask=fb, other=0.0).to(tl.float32)
        if HAS_STATE:
            Xp = tl.load(px_ptr + h * stride_pxh + slot * stride_pxs + rp[:, None] * stride_pxr
                         + p[None, :] * stride_pxp, mask=fp[:, None] & pm[None, :], other=0.0)
            X = tl.where(fp[:, None], Xp.to(tl.float32), X)
            Bp = tl.load(pb_ptr + g * stride_pbg + slot * stride_pbs + rp[:, None] * stride_pbr
                         + n[None, :] * stride_pbn, mask=fp[:, None] & nm[None, :], other=0.0)
            Bm = tl.where(fp[:, None], Bp.to(tl.float32), Bm)
            dtp = tl.load(pdt_ptr + h * stride_pdt_h + slot * stride_pdt_s + rp * stride_pdt_r, mask=fp, other=0.0)
            dt = tl.where(fp, dtp.to(tl.float32), dt)
        acum = tl.load(acum_ptr + (u * H + h) * Q + l)
        alast = tl.load(acum_ptr + (u * H + h) * Q + Q - 1)
        w = tl.exp(alast - acum) * dt
        xw = X * w[:, None]
        if _INTERP:  # no BLAS under the interpreter (see interpreter_dot)
            cs = interpreter_dot(tl.trans(xw), Bm).to(tl.float32)  # [BP, BN]
        else:
            cs = _mm(tl.trans(xw), Bm, FP32_DOT, OP)
        S = tl.exp(alast) * S + cs
        if COMMIT:
            tl.store(ssm_ptr + slot * stride_ss + h * stride_sh + p[:, None] * stride_sp + n[None, :] * stride_sn,
                     S, mask=smask)
        else:
            tl.store(ent_ptr + ((e0 + j) * H + h) * P * N + p[:, None] * N + n[None, :], S, mask=smask)


@triton.jit
def _ssd_scan_kernel(x_ptr, px_ptr, dt_ptr, pdt_ptr, b_ptr, pb_ptr, c_ptr, acum_ptr, ssm_ptr, ent_ptr, d_ptr,
                     out_ptr, item_seq_ptr, item_chunk_ptr, item_rank_ptr, seq_ent_ptr,
                     cu_ptr, p0_ptr, len_ptr, slot_ptr,
                     H, P, N, HPG,
                     stride_xt, stride_xh, stride_xp, stride_pxs, stride_pxr, stride_pxh, stride_pxp,
                     stride_dt_t, stride_dt_h, stride_pdt_s, stride_pdt_r, stride_pdt_h,
                     stride_bt, stride_bg, stride_bn, stride_pbs, stride_pbr, stride_pbg, stride_pbn,
                     stride_ct, stride_cg, stride_cn,
                     stride_ss, stride_sh, stride_sp, stride_sn,
                     stride_ot, stride_oh, stride_op,
                     Q: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_STATE: tl.constexpr, HAS_D: tl.constexpr, FP32_DOT: tl.constexpr, OP: tl.constexpr,
                     ONE_ROW_BLOCK: tl.constexpr = False):
    # ONE_ROW_BLOCK (decode steps): one program per (item, head), for the row block holding the
    # sequence's only row (p0 - k*Q); otherwise one program per row block (program_id 2).
    u = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    b = tl.load(item_seq_ptr + u).to(tl.int64)
    k = tl.load(item_chunk_ptr + u).to(tl.int64)
    rank = tl.load(item_rank_ptr + u).to(tl.int64)
    p0 = tl.load(p0_ptr + b).to(tl.int64)
    if ONE_ROW_BLOCK:
        lb = (tl.minimum(tl.maximum(p0 - k * Q, 0), Q - 1) // BLOCK_L).to(tl.int32)
    else:
        lb = tl.program_id(2)
    L = tl.load(len_ptr + b).to(tl.int64)
    c0 = tl.load(cu_ptr + b).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    l = lb * BLOCK_L + tl.arange(0, BLOCK_L).to(tl.int64)
    q = k * Q + l
    new = (q >= p0) & (q < p0 + L)
    if tl.sum(new.to(tl.int32), axis=0) > 0:  # only row blocks holding rows of this batch
        g = h // HPG
        p = tl.arange(0, BLOCK_P).to(tl.int64)
        n = tl.arange(0, BLOCK_N).to(tl.int64)
        pm = p < P
        nm = n < N
        rb = (c0 + q - p0) * new.to(tl.int64)
        Cl = tl.load(c_ptr + g * stride_cg + rb[:, None] * stride_ct + n[None, :] * stride_cn,
                     mask=new[:, None] & nm[None, :], other=0.0).to(tl.float32)  # [BL, BN]
        acl = tl.load(acum_ptr + (u * H + h) * Q + l)
        # start state of the chunk, transposed [BN, BP]: the cache's (first chunk past a
        # boundary > 0), an entry written by _ssd_state_kernel (later chunks), or 0.
        e = tl.load(seq_ent_ptr + b).to(tl.int64) + rank - 1
        lim_e = tl.where(rank > 0, P, 0)
        St = tl.load(ent_ptr + (tl.maximum(e, 0) * H + h) * P * N + p[None, :] * N + n[:, None],
                     mask=(p[None, :] < lim_e) & nm[:, None], other=0.0)
        if HAS_STATE:
            lim_c = tl.where((rank == 0) & (p0 >= Q), P, 0)
            Sc = tl.load(ssm_ptr + slot * stride_ss + h * stride_sh + p[None, :] * stride_sp + n[:, None] * stride_sn,
                         mask=(p[None, :] < lim_c) & nm[:, None], other=0.0)
            St = tl.where(rank == 0, Sc, St)
        if _INTERP:
            y_off = interpreter_dot(Cl, St).to(tl.float32)
        else:
            y_off = _mm(Cl, St, FP32_DOT, OP)
        y_off = y_off * tl.exp(acl)[:, None]  # [BL, BP]
        acc = tl.zeros((BLOCK_L, BLOCK_P), dtype=tl.float32)
        for sb in range(0, lb + 1):
            s = sb * BLOCK_L + tl.arange(0, BLOCK_L).to(tl.int64)
            qs = k * Q + s
            fbs = (qs >= p0) & (qs < p0 + L)
            fps = qs < p0
            rbs = (c0 + qs - p0) * fbs.to(tl.int64)
            rps = s * fps.to(tl.int64)
            # source rows: batch rows (fbs), pending rows of the slot (fps), else 0
            BsT = tl.load(b_ptr + g * stride_bg + rbs[None, :] * stride_bt + n[:, None] * stride_bn,
                          mask=fbs[None, :] & nm[:, None], other=0.0).to(tl.float32)  # [BN, BL]
            Xs = tl.load(x_ptr + h * stride_xh + rbs[:, None] * stride_xt + p[None, :] * stride_xp,
                         mask=fbs[:, None] & pm[None, :], other=0.0).to(tl.float32)  # [BL, BP]
            dts = tl.load(dt_ptr + h * stride_dt_h + rbs * stride_dt_t, mask=fbs, other=0.0).to(tl.float32)
            if HAS_STATE:
                Bp = tl.load(pb_ptr + g * stride_pbg + slot * stride_pbs + rps[None, :] * stride_pbr
                             + n[:, None] * stride_pbn, mask=fps[None, :] & nm[:, None], other=0.0)
                BsT = tl.where(fps[None, :], Bp.to(tl.float32), BsT)
                Xp = tl.load(px_ptr + h * stride_pxh + slot * stride_pxs + rps[:, None] * stride_pxr
                             + p[None, :] * stride_pxp, mask=fps[:, None] & pm[None, :], other=0.0)
                Xs = tl.where(fps[:, None], Xp.to(tl.float32), Xs)
                dtp = tl.load(pdt_ptr + h * stride_pdt_h + slot * stride_pdt_s + rps * stride_pdt_r, mask=fps,
                              other=0.0)
                dts = tl.where(fps, dtp.to(tl.float32), dts)
            acs = tl.load(acum_ptr + (u * H + h) * Q + s)
            if _INTERP:  # no BLAS under the interpreter (see interpreter_dot)
                cb = interpreter_dot(Cl, BsT).to(tl.float32)  # [BL, BL]
            else:
                cb = _mm(Cl, BsT, FP32_DOT, OP)
            causal = s[None, :] <= l[:, None]
            dec = tl.exp(tl.where(causal, acl[:, None] - acs[None, :], 0.0))
            m = tl.where(causal, cb * dec * dts[None, :], 0.0)
            if _INTERP:
                acc = acc + interpreter_dot(m, Xs).to(tl.float32)
            else:
                acc = acc + _mm(m, Xs, FP32_DOT, OP)
        y = acc + y_off
        if HAS_D:
            xl = tl.load(x_ptr + h * stride_xh + rb[:, None] * stride_xt + p[None, :] * stride_xp,
                         mask=new[:, None] & pm[None, :], other=0.0).to(tl.float32)
            y = y + tl.load(d_ptr + h).to(tl.float32) * xl
        tl.store(out_ptr + rb[:, None] * stride_ot + h * stride_oh + p[None, :] * stride_op,
                 round_to(y, out_ptr.dtype.element_ty), mask=new[:, None] & pm[None, :])


def _scan_output(shape: tuple, dtype: torch.dtype, dev: torch.device, meta) -> torch.Tensor:
    """The scan's output buffer: the scan writes every row of a live sequence, so when the host lists
    say that every row before ``cu_seqlens[-1]`` is live, only the trailing padding rows are zeroed
    (a zero fill of all ``[T, H, P]`` fp32 was ~90 us per layer at a 16k-token step); else (padding
    sequences with rows, a decode step's metadata without host lists) all of it."""
    cu, L = meta.host.get("cu"), meta.host.get("seq_len")
    if not cu or L is None or sum(L) != cu[-1]:
        return torch.zeros(shape, dtype=dtype, device=dev)
    out = torch.empty(shape, dtype=dtype, device=dev)
    if cu[-1] < shape[0]:
        out[cu[-1]:].zero_()
    return out


def ssd_chunk_scan_triton(x_THP, dt_TH, A_log_H, B_TGN, C_TGN, D_H, meta, state, out_dtype):
    """Kernels of :func:`unified_models.ops.mamba2.ssd_chunk_scan` (without the cache commit).

    Returns ``(y [T, H, P] in out_dtype, entries [E, H, P, N] fp32)``. For a decode step
    (``meta.uniform_decode``) the completed chunks' states are already in ``state.ssm`` and
    ``entries`` is empty (``E = 0``); the caller writes the pending rows
    (:func:`.decode.write_pending_rows`).

    Raises:
        ValueError: dtypes, a chunk size that is not a power of two, devices.
    """
    for name, t_ in (("x", x_THP), ("B", B_TGN), ("C", C_TGN)):
        if t_.dtype not in FLOAT_DTYPES:
            raise ValueError(f"ssd_chunk_scan_triton: {name} dtype {t_.dtype} must be bf16/fp16/fp32")
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"ssd_chunk_scan_triton: out_dtype {out_dtype} must be bf16/fp16/fp32")
    Q = meta.chunk_size
    if Q < 2 or Q & (Q - 1):
        raise ValueError(f"ssd_chunk_scan_triton: chunk_size {Q} must be a power of two >= 2")
    T, H, P = x_THP.shape
    G, N = B_TGN.shape[1:]
    dev = x_THP.device
    tensors = [x_THP, dt_TH, A_log_H, B_TGN, C_TGN, D_H]
    if state is not None:
        tensors += [state.ssm, state.x, state.dt, state.B]
    check_device("ssd_chunk_scan_triton", *tensors)
    out = _scan_output((T, H, P), out_dtype, dev, meta)
    E, U = (0 if meta.uniform_decode else meta.num_entries), meta.num_items
    entries = torch.empty((E, H, P, N), dtype=torch.float32, device=dev)
    if U == 0:
        return out, entries
    acum = torch.empty((U, H, Q), dtype=torch.float32, device=dev)
    ent_arg = entries if E else acum
    if state is not None:
        px, pdt, pb, ssm = state.x, state.dt, state.B, state.ssm
        spx, spdt, spb, sss = px.stride(), pdt.stride(), pb.stride(), ssm.stride()
    else:  # never read (HAS_STATE=False)
        px, pdt, pb, ssm = x_THP, dt_TH, B_TGN, acum
        spx, spdt, spb, sss = (0, 0, 0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0)
    has_state = state is not None
    fp32_dot = INTERPRET or x_THP.dtype == torch.float32
    op = tl_dtype(x_THP.dtype)
    BP = max(_MIN_DOT, next_pow2(P))
    BN = max(_MIN_DOT, next_pow2(N))
    decode = meta.uniform_decode
    launch = DECODE_SCAN_LAUNCH if decode else SCAN_LAUNCH
    BL = max(_MIN_DOT, min(launch["block_l"], Q))
    if Q % BL:
        raise ValueError(f"ssd_chunk_scan_triton: chunk_size {Q} is smaller than the row block {BL}")
    BPS = max(_MIN_DOT, min(STATE_LAUNCH["block_p"], BP))
    common = (meta.cu_seqlens, meta.start_pos, meta.seq_len, meta.slot)
    _ssd_cumsum_kernel[(U, H)](
        dt_TH, pdt, A_log_H, acum, meta.item_seq, meta.item_chunk, *common,
        H, *dt_TH.stride(), *spdt, Q=Q, HAS_STATE=has_state, num_warps=4)
    x_str = (*x_THP.stride(), *spx, *dt_TH.stride(), *spdt, *B_TGN.stride(), *spb)

    def chunk_states(commit: bool):
        _ssd_state_kernel[(meta.state_seqs.numel(), H, triton.cdiv(P, BPS))](
            x_THP, px, dt_TH, pdt, B_TGN, pb, acum, ssm, ent_arg,
            meta.state_seqs, meta.seq_item_ptr, meta.seq_entry_ptr, meta.item_chunk, *common,
            H, P, N, H // G, *x_str, *sss,
            Q=Q, BLOCK_P=BPS, BLOCK_N=BN, HAS_STATE=has_state, FP32_DOT=fp32_dot, OP=op, COMMIT=commit,
            num_warps=STATE_LAUNCH["num_warps"],
            num_stages=min(STATE_LAUNCH["num_stages"], STATE_STAGES_LONG_CHUNK) if Q > 128 else STATE_LAUNCH["num_stages"])

    # decode (meta.uniform_decode): every item starts at the slot's boundary state, so the scan
    # reads no entry and runs first; the state kernel then commits completed chunks in place.
    if meta.state_seqs.numel() and not meta.uniform_decode:
        chunk_states(commit=False)
    _ssd_scan_kernel[(U, H, 1 if decode else Q // BL)](
        x_THP, px, dt_TH, pdt, B_TGN, pb, C_TGN, acum, ssm, ent_arg, D_H if D_H is not None else A_log_H, out,
        meta.item_seq, meta.item_chunk, meta.item_rank, meta.seq_entry_ptr, *common,
        H, P, N, H // G, *x_str, *C_TGN.stride(), *sss, *out.stride(),
        Q=Q, BLOCK_L=BL, BLOCK_P=BP, BLOCK_N=BN, HAS_STATE=has_state, HAS_D=D_H is not None,
        FP32_DOT=fp32_dot, OP=op, ONE_ROW_BLOCK=decode, num_warps=launch["num_warps"],
        num_stages=launch["num_stages"])
    if meta.state_seqs.numel() and meta.uniform_decode:
        chunk_states(commit=True)
    return out, entries
