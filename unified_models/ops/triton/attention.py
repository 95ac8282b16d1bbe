"""Paged causal attention and KV-cache write in Triton (one read path for
prefill, chunked prefill, decode and training).

Cache layout: ``k_cache``/``v_cache`` are 4-D ``[num_blocks, S, G, E]`` views
with arbitrary strides (vLLM hands a strided view of one allocation). Slot
``s`` is block ``s // S``, offset ``s % S``.

Reading: one program per (token, kv head). It walks the KV positions
``0..positions[t]`` of its own sequence in tiles of ``BLOCK_KV`` positions
aligned at absolute position 0 (tile ``j`` covers ``[j*BLOCK_KV,
(j+1)*BLOCK_KV)``), in increasing order, with an fp32 online softmax. Each
position's physical block is looked up through the block table on its own
(``block_table[seq, p // S]``), so the tiling, and hence the bits, do not
depend on the cache block size ``S`` or on which physical blocks hold the
sequence. The loop bound is the token's own last tile: a token's result never
depends on the other tokens of the batch, so prefill, chunked prefill and
decode give the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..attention import KV_FP8_DTYPE, check_kv_scales
from ._common import _INTERP, FLOAT_DTYPES, INTERPRET, check_device, interpreter_dot, e4m3_bits_to_f32, next_pow2, round_to

if INTERPRET:
    # Short tiles so that small test sequences still span several tiles.
    BLOCK_KV = 16
    NUM_WARPS, NUM_STAGES = 4, 1
else:
    BLOCK_KV = 64
    NUM_WARPS, NUM_STAGES = 4, 2

MIN_BLOCK_H = 16
"""The q heads of one kv head are padded to at least 16 rows (tensor-core ``tl.dot`` minimum)."""

_LOG2E = 1.4426950408889634
_INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def f32_to_e4m3_bits(x):
    """fp32 -> float8_e4m3fn bit patterns (int32 0..255): saturate to +-448, round to
    nearest even (subnormals included), keep the sign (also of zero); NaN -> 0x7F | sign.

    Integer arithmetic on the fp32 bits plus one exact power-of-two scaling and
    a 2^23 round-to-integer for the subnormal range, so no hardware fp8
    conversion or unary minus (which drops -0.0 on the GPU) is involved.
    """
    u = x.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    is_nan = a > 0x7F800000
    a = tl.minimum(a, 0x43E00000)  # |x| <= 448 (the bits of non-negative floats are ordered like their values)
    # normal range (|x| >= 2^-6): drop 20 mantissa bits, ties to even; exponent bias 127 -> 7
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal range: |x| / 2^-9 rounded to an integer 0..8 (8 = the smallest normal, code 0x08)
    f = a.to(tl.float32, bitcast=True) * 512.0
    sub = ((f + 8388608.0) - 8388608.0).to(tl.int32)
    mag = tl.where(a >= 0x3C800000, normal, sub)
    mag = tl.where(is_nan, 0x7F, mag)
    return mag | sign


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, G, E, S,
                     stride_kt, stride_kg, stride_ke, stride_vt, stride_vg, stride_ve,
                     stride_kcb, stride_kcs, stride_kcg, stride_kce,
                     stride_vcb, stride_vcs, stride_vcg, stride_vce,
                     BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr, FP8: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    e = tl.arange(0, BLOCK_E)
    mask = (g[:, None] < G) & (e[None, :] < E)
    valid = slot >= 0  # slot < 0: padding token, nothing written
    blk = tl.where(valid, slot // S, 0)
    off = tl.where(valid, slot % S, 0)
    g_lim = tl.where(valid, G, 0)  # (a scalar bool in a mask trips the interpreter)
    store_mask = (g[:, None] < g_lim) & (e[None, :] < E)
    k = tl.load(k_ptr + t * stride_kt + g[:, None] * stride_kg + e[None, :] * stride_ke, mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + g[:, None] * stride_vg + e[None, :] * stride_ve, mask=mask, other=0.0)
    kc = kc_ptr + blk * stride_kcb + off * stride_kcs + g[:, None] * stride_kcg + e[None, :] * stride_kce
    vc = vc_ptr + blk * stride_vcb + off * stride_vcs + g[:, None] * stride_vcg + e[None, :] * stride_vce
    if FP8:  # caches are uint8 views of float8_e4m3fn
        ks = tl.load(ks_ptr)
        vs = tl.load(vs_ptr)
        tl.store(kc, f32_to_e4m3_bits(tl.math.div_rn(k.to(tl.float32), ks)).to(tl.uint8), mask=store_mask)
        tl.store(vc, f32_to_e4m3_bits(tl.math.div_rn(v.to(tl.float32), vs)).to(tl.uint8), mask=store_mask)
    else:
        tl.store(kc, round_to(k.to(tl.float32), kc_ptr.dtype.element_ty), mask=store_mask)
        tl.store(vc, round_to(v.to(tl.float32), vc_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _paged_attention_kernel(
        q_ptr, kc_ptr, vc_ptr, bt_ptr, seq_ptr, pos_ptr, out_ptr, ks_ptr, vs_ptr,
        qk_scale, E, S,
        stride_qt, stride_qh, stride_qe,
        stride_kcb, stride_kcs, stride_kcg, stride_kce,
        stride_vcb, stride_vcs, stride_vcg, stride_vce,
        stride_btb, stride_btn,
        stride_ot, stride_oh, stride_oe,
        Q_PER_KV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr,
        BLOCK_KV: tl.constexpr, FP32_DOT: tl.constexpr, FP8: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    seq = tl.load(seq_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)

    r = tl.arange(0, BLOCK_H)
    h = g * Q_PER_KV + r
    mask_h = r < Q_PER_KV
    e = tl.arange(0, BLOCK_E)
    mask_e = e < E
    q = tl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + e[None, :] * stride_qe,
                mask=mask_h[:, None] & mask_e[None, :], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    if FP8:
        ks = tl.load(ks_ptr)
        vs = tl.load(vs_ptr)

    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_E), dtype=tl.float32)

    # The token's own last tile; a negative position (padding token) runs no tile.
    num_tiles = tl.where(pos >= 0, pos // BLOCK_KV + 1, 0).to(tl.int32)
    bt_row = bt_ptr + seq * stride_btb
    for j in range(0, num_tiles):
        p = j * BLOCK_KV + tl.arange(0, BLOCK_KV).to(tl.int64)
        valid = p <= pos
        blk = tl.load(bt_row + (p // S) * stride_btn, mask=valid, other=0).to(tl.int64)
        off = p % S
        # K^T tile [BLOCK_E, BLOCK_KV]; masked entries read as 0 so stale cache
        # memory (possibly NaN) never reaches the math.
        kt = tl.load(kc_ptr + blk[None, :] * stride_kcb + off[None, :] * stride_kcs + g * stride_kcg
                     + e[:, None] * stride_kce, mask=mask_e[:, None] & valid[None, :], other=0.0)
        if FP8:  # read rule: q.dtype(fp32(e4m3) * k_scale)
            kt = round_to(e4m3_bits_to_f32(kt.to(tl.int32)) * ks, q_ptr.dtype.element_ty)
        if _INTERP:  # no BLAS under the interpreter (see interpreter_dot)
            s = interpreter_dot(q, kt).to(tl.float32)
        elif FP32_DOT:
            s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, kt.to(q.dtype))
        s = s * qk_scale  # log2 domain
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        v = tl.load(vc_ptr + blk[:, None] * stride_vcb + off[:, None] * stride_vcs + g * stride_vcg
                    + e[None, :] * stride_vce, mask=valid[:, None] & mask_e[None, :], other=0.0)
        if FP8:
            v = round_to(e4m3_bits_to_f32(v.to(tl.int32)) * vs, q_ptr.dtype.element_ty)
        if _INTERP:
            pv = interpreter_dot(pr, v).to(tl.float32)
        elif FP32_DOT:
            pv = tl.dot(pr, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(pr.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + e[None, :] * stride_oe,
             round_to(out, out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_e[None, :])


def _check_cache(name: str, cache: torch.Tensor, G: int, E: int) -> None:
    if cache.dim() != 4 or cache.shape[2] != G or cache.shape[3] != E:
        raise ValueError(f"{name} must be a 4-D [num_blocks, S, {G}, {E}] view, got {tuple(cache.shape)}")
    if cache.dtype not in FLOAT_DTYPES and cache.dtype != KV_FP8_DTYPE:
        raise ValueError(f"{name} dtype must be bf16/fp16/fp32/float8_e4m3fn, got {cache.dtype}")


def _kernel_views(k_cache, v_cache, scales):
    """``(k, v, k_scale, v_scale, fp8)`` kernel arguments: uint8 bit views and the
    scales for an FP8 cache, the caches themselves (and unused scale pointers) otherwise."""
    if scales is None:
        return k_cache, v_cache, k_cache, v_cache, False
    return k_cache.view(torch.uint8), v_cache.view(torch.uint8), scales[0], scales[1], True


def write_kv_cache_triton(k_TGE: torch.Tensor, v_TGE: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping_T: torch.Tensor,
                          k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write each token's K and V into its cache slot (in place).

    Model-dtype caches get an exact copy cast to the cache dtype; float8_e4m3fn
    caches get ``e4m3(clamp(div_rn(fp32(k), k_scale), -448, 448))`` (RNE,
    :func:`f32_to_e4m3_bits`), the same for V.

    Args:
        k_TGE: ``[T, G, E]`` keys (bf16/fp16/fp32, any strides).
        v_TGE: ``[T, G, E]`` values.
        k_cache: ``[num_blocks, S, G, E]`` view with arbitrary strides.
        v_cache: same shape as ``k_cache`` (strides may differ).
        slot_mapping_T: int32/int64 ``[T]``; slot = block * S + offset; a
            negative slot marks a padding token and is skipped.
        k_scale, v_scale: fp32 ``[]`` scales of an FP8 cache (else None).

    Raises:
        ValueError: wrong ranks/shapes/dtypes or devices; missing, superfluous
            or bad scales (``ops.attention.check_kv_scales``).
    """
    if k_TGE.dim() != 3 or v_TGE.shape != k_TGE.shape:
        raise ValueError(f"write_kv_cache_triton: k {tuple(k_TGE.shape)} and v {tuple(v_TGE.shape)} "
                         "must both be [T, G, E]")
    if k_TGE.dtype not in FLOAT_DTYPES or v_TGE.dtype not in FLOAT_DTYPES:
        raise ValueError(f"write_kv_cache_triton: k/v dtype must be bf16/fp16/fp32, got {k_TGE.dtype}/{v_TGE.dtype}")
    T, G, E = k_TGE.shape
    _check_cache("write_kv_cache_triton: k_cache", k_cache, G, E)
    _check_cache("write_kv_cache_triton: v_cache", v_cache, G, E)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"write_kv_cache_triton: k_cache {tuple(k_cache.shape)} and v_cache "
                         f"{tuple(v_cache.shape)} differ")
    if slot_mapping_T.shape != (T,) or slot_mapping_T.dtype not in _INDEX_DTYPES:
        raise ValueError(f"write_kv_cache_triton: slot_mapping must be int32/int64 [{T}], got "
                         f"{tuple(slot_mapping_T.shape)} {slot_mapping_T.dtype}")
    check_device("write_kv_cache_triton", k_TGE, v_TGE, k_cache, v_cache, slot_mapping_T)
    scales = check_kv_scales("write_kv_cache_triton", k_cache, v_cache, k_scale, v_scale)
    if T == 0:
        return
    S = k_cache.shape[1]
    kc, vc, ks, vs, fp8 = _kernel_views(k_cache, v_cache, scales)
    _write_kv_kernel[(T,)](
        k_TGE, v_TGE, kc, vc, slot_mapping_T, ks, vs, G, E, S,
        *k_TGE.stride(), *v_TGE.stride(), *kc.stride(), *vc.stride(),
        BLOCK_G=next_pow2(G), BLOCK_E=next_pow2(E), FP8=fp8, num_warps=4)


def paged_attention_triton(q_THE: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table_BN: torch.Tensor, seq_idx_T: torch.Tensor,
                           positions_T: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal paged attention (GQA), batch-invariant per token.

    Token ``t`` attends to positions ``0..positions_T[t]`` of sequence
    ``seq_idx_T[t]`` (its row of ``block_table_BN``); those positions must
    already be in the cache (write the current tokens first). q head ``h``
    uses kv head ``h // (H // G)``.

    Args:
        q_THE: ``[T, H, E]`` queries (bf16/fp16/fp32, any strides).
        k_cache: ``[num_blocks, S, G, E]`` view, arbitrary strides, any ``S``.
        v_cache: same shape as ``k_cache``.
        block_table_BN: int32 ``[B, max_blocks]``; entry ``[b, i]`` is the
            physical block holding positions ``[i*S, (i+1)*S)`` of sequence ``b``.
        seq_idx_T: int32/int64 ``[T]``, row of ``block_table_BN`` per token.
        positions_T: int32/int64 ``[T]``, position of the token in its own
            sequence; a negative position marks a padding token (zero output).
        scale: softmax scale (e.g. ``E ** -0.5``).
        k_scale, v_scale: fp32 ``[]`` scales of a float8_e4m3fn cache (else
            None): K/V tiles are read as ``q.dtype(fp32(e4m3) * scale)``.

    Returns:
        ``[T, H, E]`` in ``q_THE.dtype`` (rounded once from fp32).

    Raises:
        ValueError: wrong ranks/shapes/dtypes, ``H`` not a multiple of ``G``,
            devices differ; missing, superfluous or bad scales.

    Numerics: scores and the online softmax are fp32 (exp2 with the scale
    folded in); on GPU the dot operands are ``q``'s dtype (K/V tiles and the
    probabilities are cast to it for the tensor-core ``tl.dot``, fp32
    accumulation); for fp32 ``q`` everything is fp32 (IEEE dot). Under the
    interpreter (CPU) the two products are :func:`interpreter_dot` (exact fp64
    products, numpy's fixed summation order, one rounding to fp32), so no
    host BLAS kernel decides any bit.
    """
    if q_THE.dim() != 3 or q_THE.dtype not in FLOAT_DTYPES:
        raise ValueError(f"paged_attention_triton: q must be [T, H, E] bf16/fp16/fp32, got "
                         f"{tuple(q_THE.shape)} {q_THE.dtype}")
    T, H, E = q_THE.shape
    if k_cache.dim() != 4 or k_cache.shape[3] != E:
        raise ValueError(f"paged_attention_triton: k_cache must be [num_blocks, S, G, {E}], got "
                         f"{tuple(k_cache.shape)}")
    G = k_cache.shape[2]
    _check_cache("paged_attention_triton: k_cache", k_cache, G, E)
    _check_cache("paged_attention_triton: v_cache", v_cache, G, E)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_attention_triton: k_cache {tuple(k_cache.shape)} and v_cache "
                         f"{tuple(v_cache.shape)} differ")
    if G == 0 or H % G != 0:
        raise ValueError(f"paged_attention_triton: H={H} q heads is not a multiple of G={G} kv heads")
    if block_table_BN.dim() != 2 or block_table_BN.dtype not in _INDEX_DTYPES:
        raise ValueError(f"paged_attention_triton: block_table must be int32 [B, max_blocks], got "
                         f"{tuple(block_table_BN.shape)} {block_table_BN.dtype}")
    for name, idx in (("seq_idx", seq_idx_T), ("positions", positions_T)):
        if idx.shape != (T,) or idx.dtype not in _INDEX_DTYPES:
            raise ValueError(f"paged_attention_triton: {name} must be int32/int64 [{T}], got "
                             f"{tuple(idx.shape)} {idx.dtype}")
    check_device("paged_attention_triton", q_THE, k_cache, v_cache, block_table_BN, seq_idx_T, positions_T)
    scales = check_kv_scales("paged_attention_triton", k_cache, v_cache, k_scale, v_scale)
    out = torch.empty((T, H, E), dtype=q_THE.dtype, device=q_THE.device)
    if T == 0:
        return out
    S = k_cache.shape[1]
    q_per_kv = H // G
    fp32_dot = INTERPRET or q_THE.dtype == torch.float32
    kc, vc, ks, vs, fp8 = _kernel_views(k_cache, v_cache, scales)
    _paged_attention_kernel[(T, G)](
        q_THE, kc, vc, block_table_BN, seq_idx_T, positions_T, out, ks, vs,
        float(scale) * _LOG2E, E, S,
        *q_THE.stride(), *kc.stride(), *vc.stride(), *block_table_BN.stride(), *out.stride(),
        Q_PER_KV=q_per_kv, BLOCK_H=max(MIN_BLOCK_H, next_pow2(q_per_kv)), BLOCK_E=max(16, next_pow2(E)),
        BLOCK_KV=BLOCK_KV, FP32_DOT=fp32_dot, FP8=fp8, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out
