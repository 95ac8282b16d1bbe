"""DeepSeek-V4 MoE in Triton: the sqrt-softplus / hash router's selection, and the clamped-SwiGLU
routed experts as a grouped GEMM.

Shapes: T tokens, D hidden, E routed experts, K top-k, R = T*K assignments, I expert width,
V vocabulary. Math and rounding points: package doc of :mod:`.deepseek` (transformers 5.19
``DeepseekV4TopKRouter``, ``DeepseekV4HashRouter``, ``DeepseekV4Experts``).

**Router selection** (:func:`sqrtsoftplus_select_triton`, :func:`hash_select_triton`): the
logits come from the package's router GEMM (:func:`.dispatch.router_logits`, the batch-invariant
Triton linear with fp32 output); one program then takes a tile of ``BLOCK_T`` tokens with all
``E`` experts in registers (``BLOCK_T`` a function of ``E`` only) and computes, per row:

* ``s = sqrt_rn(softplus(l))``, ``softplus(l) = l`` for ``l > 20`` (torch's threshold), else
  ``max(l, 0) + log1p(exp(-|l|))`` with ``log1p(e) = 2 atanh(e / (2 + e))`` as its odd series to
  ``z^15`` (``z <= 1/3``: truncation < 2e-9 relative; no ``log1p`` exists in ``tl``);
* top-k of ``c = s + bias`` (bias only selects) as the package's total order: the int64 key
  ``(ordered int32 image of c) << 32 | (E - 1 - e)`` (``-0.0`` made ``+0.0``), the row max taken
  ``K`` times (``tl.max`` is exact, so its reduction order cannot matter), each winner masked
  out: **ties go to the lower expert index**, slots best first, exactly the CPU rule
  (:func:`.dispatch.total_order_keys`);
* hash layers: ``ids = tid2eid[input_ids]`` (slot order = the table's columns);
* weights ``s[ids]``, divided (IEEE ``div_rn``) by ``((0 + w_0) + w_1 + ... + w_{K-1}) + 1e-20``
  when ``norm_topk_prob``, then times ``routed_scaling_factor`` (fp32).

**Experts** (:func:`swiglu_expert_outputs_triton`): the Nemotron-H grouped GEMM of
:mod:`.triton` (assignments sorted by ``(expert, t, k)``, each expert's run padded to
``BLOCK_M`` so a row tile has one expert, a full K loop per program in fixed ``BLOCK_K`` steps,
no split-K, no atomics, tiles fixed per device) in two launches:

1. gate + up (:func:`_swiglu_gate_up_kernel`, new here): one program computes the
   ``[BLOCK_M, BLOCK_N]`` tiles of ``g = x w1_e^T`` and ``u = x w3_e^T`` from the same ``x``
   tile (two fp32 accumulators, bf16 tensor cores), epilogue
   ``h = round_x((silu(min(g, L)) * clamp(u, -L, L)) * w_tk)`` in fp32, ``silu(g) = g / (1 + exp(-g))``
   (IEEE division), clamps propagating NaN; NVFP4 and block-FP8 weights are dequantized in the
   K loop by :func:`.triton._w_tile` (ModelOpt's rule, as the Nemotron-H kernel; DeepSeek's
   ``weight_dequant``, exact);
2. down: :mod:`.triton`'s ``_moe_gemm_kernel`` unchanged (fp32 rows scattered to ``y[t*K + k]``).

The combine is :func:`.dispatch.moe_combine` (the Nemotron-H Triton combine, fp32 slot order).
The shared expert (one expert, every token) skips the sort: its plan is the identity layout,
the same tensors :func:`.triton.moe_plan` builds for one expert.

Under the interpreter (CPU) the dots are exact fp64 products summed in numpy's fixed order
(:func:`interpreter_dot`) and rounded once, so ``g``/``u``/``y`` equal the CPU path's exact
sums; ``exp`` is numpy's. On the GPU ``tl.exp`` is the hardware's approximate exponential and
fp32 mul + add may contract to FMA: other bits than the CPU path, the same bits for every row
of every batch (rollout and trainer on one GPU agree). Tolerances against the fp64 oracle:
``tests/ops/test_deepseek_moe.py`` (``test_triton_*``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..nvfp4 import NVFP4Weight
from ..triton._common import _INTERP, INTERPRET, check_device, interpreter_dot, next_pow2, round_f64_to, round_to
from .common import NORM_EPS
from ..fp8_block.common import BLOCK as FP8_BLOCK
from ..fp8_block.experts import FP8BlockExperts
from .triton import BLOCK_M, FMT_NVFP4, NUM_STAGES, _launch, _w_tile, _weight_args, moe_plan

if INTERPRET:
    GATE_UP_N, GATE_UP_K, GATE_UP_WARPS, GATE_UP_WARPS_NVFP4 = 128, 64, 4, 4
    ROUTER_ELEMS, ROUTER_WARPS = 8192, 4
else:
    # Two fp32 accumulators per program: BLOCK_N = 64 keeps them at 64 registers per thread
    # with 4 warps; NVFP4 (two in-loop dequantizations) takes 8 warps. Chosen so that ptxas
    # (sm_90a) reports no register spills; not timed on the H200 yet.
    GATE_UP_N, GATE_UP_K, GATE_UP_WARPS, GATE_UP_WARPS_NVFP4 = 64, 64, 4, 8
    ROUTER_ELEMS, ROUTER_WARPS = 4096, 8

assert FP8_BLOCK % GATE_UP_K == 0, "a block-FP8 weight tile's K range must lie in one 128-wide scale block"
assert NORM_EPS == 1e-20, "the selection kernel adds the literal 1e-20 (common.NORM_EPS)"

SOFTPLUS_THRESHOLD = 20.0
"""``softplus(l) = l`` above this (torch's ``F.softplus`` default, transformers' ``SqrtSoftplusActivation``;
the kernel's literal 20.0)."""

_DTYPES = (torch.bfloat16, torch.float32)
_INT64_MIN = tl.constexpr(-(2 ** 63))
"""Key of a masked-out candidate: below every real key (the ordered int32 image of an fp32 is
> -2**31 except for the one NaN pattern 0xFFFFFFFF)."""


def router_block_t(num_experts: int) -> int:
    """Tokens per router program: ``ROUTER_ELEMS // next_pow2(E)`` clamped to [1, 64]; a function
    of ``E`` and the device kind only, never of ``T``."""
    return max(1, min(64, ROUTER_ELEMS // next_pow2(num_experts)))


# ----------------------------------------------------------------------------- router


@triton.jit
def _log1p_small(e):
    """``log1p(e)`` for ``0 <= e <= 1``: ``2 atanh(z)``, ``z = e / (2 + e) <= 1/3``, odd series to ``z^15``."""
    z = tl.math.div_rn(e, 2.0 + e)
    z2 = z * z
    p = 1.0 / 15.0
    p = 1.0 / 13.0 + z2 * p
    p = 1.0 / 11.0 + z2 * p
    p = 1.0 / 9.0 + z2 * p
    p = 1.0 / 7.0 + z2 * p
    p = 1.0 / 5.0 + z2 * p
    p = 1.0 / 3.0 + z2 * p
    p = 1.0 + z2 * p
    return 2.0 * z * p


@triton.jit
def _sqrtsoftplus(x):
    """``sqrt(softplus(x))`` in fp32 (threshold 20, as torch)."""
    sp = tl.maximum(x, 0.0) + _log1p_small(tl.exp(-tl.abs(x)))
    sp = tl.where(x > 20.0, x, sp)
    return tl.sqrt_rn(sp)


@triton.jit(do_not_specialize=["T"])
def _deepseek_select_kernel(logits_ptr, bias_ptr, table_ptr, tok_ptr, w_ptr, ids_ptr,
                            T, E, V, stride_lt, stride_le, stride_tv, stride_tk, stride_wt, stride_it, rsf,
                            TOPK: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr, HASH: tl.constexpr,
                            NORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    cols = tl.arange(0, BLOCK_E)
    mask_e = cols < E
    mask = mask_t[:, None] & mask_e[None, :]
    lg = tl.load(logits_ptr + offs_t[:, None] * stride_lt + cols[None, :] * stride_le, mask=mask, other=0.0)
    s = _sqrtsoftplus(lg.to(tl.float32))
    slot = tl.arange(0, KP)
    wts = tl.zeros((BLOCK_T, KP), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, KP), dtype=tl.int32)
    den = tl.zeros((BLOCK_T,), dtype=tl.float32)
    if HASH:
        tok = tl.load(tok_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
        tok = tl.where((tok >= 0) & (tok < V), tok, 0)  # unchecked on CUDA (no host sync); memory-safe
        for k in tl.static_range(TOPK):
            e = tl.load(table_ptr + tok * stride_tv + k * stride_tk, mask=mask_t, other=0).to(tl.int32)
            e = tl.minimum(tl.maximum(e, 0), E - 1)
            wk = tl.sum(tl.where(cols[None, :] == e[:, None], s, 0.0), axis=1)  # one nonzero term: exact
            wts = tl.where(slot[None, :] == k, wk[:, None], wts)
            ids = tl.where(slot[None, :] == k, e[:, None], ids)
            den = den + wk
    else:
        c = s
        if HAS_BIAS:
            c = c + tl.load(bias_ptr + cols, mask=mask_e, other=0.0).to(tl.float32)[None, :]
        c = tl.where(c == 0.0, 0.0, c)  # -0.0 == +0.0
        bits = c.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
        key = (ordered << 32) + (E - 1 - cols).to(tl.int64)[None, :]
        key = tl.where(mask_e[None, :], key, _INT64_MIN)
        for k in tl.static_range(TOPK):
            best = tl.max(key, axis=1)
            hit = key == best[:, None]  # keys of a row are distinct: one hit
            e = E - 1 - best.to(tl.int32)  # low 32 bits (truncation): E - 1 - column
            wk = tl.sum(tl.where(hit, s, 0.0), axis=1)
            key = tl.where(hit, _INT64_MIN, key)
            wts = tl.where(slot[None, :] == k, wk[:, None], wts)
            ids = tl.where(slot[None, :] == k, e[:, None], ids)
            den = den + wk
    if NORM:
        wts = tl.math.div_rn(wts, (den + 1e-20)[:, None])
    wts = wts * rsf
    out_mask = mask_t[:, None] & (slot < TOPK)[None, :]
    tl.store(w_ptr + offs_t[:, None] * stride_wt + slot[None, :], wts, mask=out_mask)
    tl.store(ids_ptr + offs_t[:, None] * stride_it + slot[None, :], ids, mask=out_mask)


def _select(logits_TE, bias_E, table_VK, tok_T, top_k, norm_topk_prob, routed_scaling_factor):
    T, E = logits_TE.shape
    check_device("deepseek_select_triton", logits_TE, bias_E, table_VK, tok_T)
    w = torch.empty(T, top_k, dtype=torch.float32, device=logits_TE.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits_TE.device)
    if T == 0:
        return w, ids
    hashed = table_VK is not None
    bt = router_block_t(E)
    dummy = logits_TE
    _deepseek_select_kernel[(triton.cdiv(T, bt),)](
        logits_TE, bias_E if bias_E is not None else dummy, table_VK if hashed else dummy,
        tok_T if hashed else dummy, w, ids, T, E, table_VK.shape[0] if hashed else 0,
        logits_TE.stride(0), logits_TE.stride(1), table_VK.stride(0) if hashed else 0,
        table_VK.stride(1) if hashed else 0, w.stride(0), ids.stride(0), float(routed_scaling_factor),
        TOPK=top_k, KP=next_pow2(top_k), HAS_BIAS=bias_E is not None, HASH=hashed, NORM=bool(norm_topk_prob),
        BLOCK_T=bt, BLOCK_E=next_pow2(E), num_warps=ROUTER_WARPS)
    return w, ids


def sqrtsoftplus_select_triton(logits_TE: torch.Tensor, bias_E: torch.Tensor | None, *, top_k: int,
                               norm_topk_prob: bool, routed_scaling_factor: float
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router steps 2-4 of :mod:`.deepseek` in one kernel (module doc).

    Args:
        logits_TE: fp32 ``[T, E]`` router logits (any strides).
        bias_E: fp32 ``[E]`` selection bias or None. top_k: in ``[1, E]`` (checked by the caller).

    Returns:
        ``(weights_TK fp32, ids_TK int32)``, slots best first, ties to the lower expert index;
        row ``t`` depends only on ``logits_TE[t]``.

    Raises:
        ValueError: logits not fp32, bias not fp32 ``[E]``, tensors on different devices.
    """
    if logits_TE.dtype != torch.float32:
        raise ValueError(f"sqrtsoftplus_select_triton: logits must be fp32, got {logits_TE.dtype}")
    if bias_E is not None:
        bias_E = bias_E.float().contiguous()
    return _select(logits_TE, bias_E, None, None, top_k, norm_topk_prob, routed_scaling_factor)


def hash_select_triton(logits_TE: torch.Tensor, tid2eid_VK: torch.Tensor, input_ids_T: torch.Tensor, *,
                       norm_topk_prob: bool, routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash routing in one kernel: ``ids = tid2eid[input_ids]`` (int32 ``[T, K]``), weights from
    ``sqrt(softplus(logits))`` at the ids (module doc).

    On CUDA the ranges are not checked (that needs a host sync, which CUDA graphs forbid; the
    dispatcher checks CPU tensors): a token id outside ``[0, V)`` reads table row 0 and a table
    entry outside ``[0, E)`` is clamped into it, so the kernel never reads out of bounds.

    Raises:
        ValueError: logits not fp32, tensors on different devices.
    """
    if logits_TE.dtype != torch.float32:
        raise ValueError(f"hash_select_triton: logits must be fp32, got {logits_TE.dtype}")
    K = tid2eid_VK.shape[1]
    return _select(logits_TE, None, tid2eid_VK, input_ids_T, K, norm_topk_prob, routed_scaling_factor)


# ----------------------------------------------------------------------------- experts


@triton.jit
def _silu_clamped(g, u, limit):
    """``silu(min(g, L)) * clamp(u, -L, L)`` in fp32 (NaN propagates through the clamps, as torch's)."""
    g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
    u = tl.minimum(tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                   propagate_nan=tl.PropagateNan.ALL)
    return tl.math.div_rn(g, 1.0 + tl.exp(-g)) * u


@triton.jit(do_not_specialize=["R"])
def _swiglu_gate_up_kernel(a_ptr, wg_ptr, wgs_ptr, wgs2_ptr, wu_ptr, wus_ptr, wus2_ptr, rw_ptr, h_ptr,
                           ids_ptr, tile_expert_ptr, R, N, K, E, limit,
                           stride_am, stride_ak,
                           stride_ge, stride_gn, stride_gk, stride_gse, stride_gsn, stride_gsk,
                           stride_ue, stride_un, stride_uk, stride_use, stride_usn, stride_usk,
                           stride_hm, stride_hn,
                           TOPK: tl.constexpr, FMT_G: tl.constexpr, FMT_U: tl.constexpr,
                           FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``h`` (padded expert-sorted layout): gate and up GEMMs over
    the full K in fixed steps from the same ``x`` rows, then the clamped-SwiGLU epilogue times the
    routing weight, one rounding to ``h``'s dtype."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    e = tl.load(tile_expert_ptr + pid_m)
    if e < E:
        e64 = e.to(tl.int64)
        offs_p = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        rid = tl.load(ids_ptr + offs_p).to(tl.int64)
        valid = rid < R
        arow = rid // TOPK
        offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        if FMT_G == FMT_NVFP4:
            gs2 = tl.load(wgs2_ptr + e64)
        else:
            gs2 = 0.0
        if FMT_U == FMT_NVFP4:
            us2 = tl.load(wus2_ptr + e64)
        else:
            us2 = 0.0
        a_ptrs = a_ptr + arow[:, None] * stride_am + offs_k[None, :] * stride_ak
        wdt = a_ptr.dtype.element_ty
        if _INTERP:
            # exact fp64 products summed in numpy's fixed order, one rounding (== the CPU path's sums)
            acc_g64 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float64)
            acc_u64 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float64)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + offs_k
                mask_k = kk < K
                a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
                wg = _w_tile(wg_ptr, wgs_ptr, gs2, e64, offs_n, mask_n, k0, K, stride_ge, stride_gn, stride_gk,
                             stride_gse, stride_gsn, stride_gsk, FMT_G, wdt, BLOCK_K)
                wu = _w_tile(wu_ptr, wus_ptr, us2, e64, offs_n, mask_n, k0, K, stride_ue, stride_un, stride_uk,
                             stride_use, stride_usn, stride_usk, FMT_U, wdt, BLOCK_K)
                acc_g64 += interpreter_dot(a, wg)
                acc_u64 += interpreter_dot(a, wu)
                a_ptrs += BLOCK_K * stride_ak
            acc_g = round_f64_to(acc_g64, tl.float32)
            acc_u = round_f64_to(acc_u64, tl.float32)
        else:
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + offs_k
                mask_k = kk < K
                a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
                wg = _w_tile(wg_ptr, wgs_ptr, gs2, e64, offs_n, mask_n, k0, K, stride_ge, stride_gn, stride_gk,
                             stride_gse, stride_gsn, stride_gsk, FMT_G, wdt, BLOCK_K)
                wu = _w_tile(wu_ptr, wus_ptr, us2, e64, offs_n, mask_n, k0, K, stride_ue, stride_un, stride_uk,
                             stride_use, stride_usn, stride_usk, FMT_U, wdt, BLOCK_K)
                if FP32_DOT:
                    af = a.to(tl.float32)
                    acc_g = tl.dot(af, wg.to(tl.float32), acc_g, input_precision="ieee")
                    acc_u = tl.dot(af, wu.to(tl.float32), acc_u, input_precision="ieee")
                else:
                    acc_g = tl.dot(a, wg, acc_g)
                    acc_u = tl.dot(a, wu, acc_u)
                a_ptrs += BLOCK_K * stride_ak
        rw = tl.load(rw_ptr + rid, mask=valid, other=0.0).to(tl.float32)
        h = _silu_clamped(acc_g, acc_u, limit) * rw[:, None]
        h_ptrs = h_ptr + offs_p[:, None] * stride_hm + offs_n[None, :] * stride_hn
        tl.store(h_ptrs, round_to(h, h_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


def _nvfp4_tensors(w):
    """The tensors of a weight (NVFP4: codes and both scales; block FP8: bytes and scales) for the device check."""
    if isinstance(w, NVFP4Weight):
        return w.weight, w.weight_scale, w.weight_scale_2
    if isinstance(w, FP8BlockExperts):
        return w.weight, w.weight_scale_inv
    return (w,)


def expert_plan(topk_ids_TK: torch.Tensor, num_experts: int):
    """The padded expert-sorted layout of :func:`.triton.moe_plan` (``exact`` under the interpreter,
    the sync-free upper bound on GPU). One expert and one slot (the shared expert): the identity
    layout ``0..R-1`` padded with ``R`` built directly, the same tensors ``moe_plan`` returns for it
    (``tests/ops/test_deepseek_moe.py::test_triton_one_expert_plan_is_moe_plan``) without a sort."""
    T, K = topk_ids_TK.shape
    if num_experts != 1 or K != 1:
        return moe_plan(topk_ids_TK, num_experts, BLOCK_M, exact=INTERPRET)
    R = T * K
    dev = topk_ids_TK.device
    n_tiles = triton.cdiv(R, BLOCK_M) + (0 if INTERPRET else min(1, R))
    sorted_ids = torch.arange(n_tiles * BLOCK_M, dtype=torch.int32, device=dev).clamp_(max=R)
    tile_expert = (torch.arange(n_tiles, dtype=torch.int32, device=dev) * BLOCK_M >= R).to(torch.int32)
    return sorted_ids, tile_expert, n_tiles


def swiglu_hidden_triton(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, gate, up,
                         swiglu_limit: float):
    """The gate/up half of :func:`swiglu_expert_outputs_triton`: ``h = round_x(swiglu_L(x w1^T, x w3^T) * w)``
    for every assignment, in the expert-sorted padded row order of :func:`expert_plan`.

    Returns:
        ``(h, plan)``: ``h`` ``[n_tiles * BLOCK_M, I]`` in ``x``'s dtype (padding rows unspecified) and
        the plan ``(sorted_ids, tile_expert, n_tiles)``; ``h`` None when there is nothing to compute.

    Raises:
        ValueError: dtypes, shapes or devices do not match.
    """
    if x_TD.dtype not in _DTYPES:
        raise ValueError(f"swiglu_expert_outputs_triton: x must be bf16 or fp32, got {x_TD.dtype}")
    E, I, D = up.shape
    if tuple(gate.shape) != (E, I, D) or x_TD.shape[1] != D:
        raise ValueError(f"swiglu_expert_outputs_triton: x {tuple(x_TD.shape)}, gate {list(gate.shape)}, up "
                         f"{list(up.shape)} do not match")
    tensors = [x_TD, topk_ids_TK, topk_weights_TK] + [t for w in (gate, up) for t in _nvfp4_tensors(w)]
    check_device("swiglu_expert_outputs_triton", *tensors)
    T, K = topk_ids_TK.shape
    R = T * K
    if R == 0 or D == 0 or I == 0:
        return None, None
    sorted_ids, tile_expert, n_tiles = expert_plan(topk_ids_TK, E)
    if n_tiles == 0:
        return None, None
    h = torch.empty(n_tiles * BLOCK_M, I, dtype=x_TD.dtype, device=x_TD.device)
    rw = topk_weights_TK.float().contiguous().view(-1)
    g_ptr, gs_ptr, gs2_ptr, g_str, gs_str, g_fmt = _weight_args(gate, "gate", x_TD.dtype)
    u_ptr, us_ptr, us2_ptr, u_str, us_str, u_fmt = _weight_args(up, "up", x_TD.dtype)
    g_fp4, u_fp4 = g_fmt == FMT_NVFP4.value, u_fmt == FMT_NVFP4.value
    grid = (n_tiles * triton.cdiv(I, GATE_UP_N),)
    _swiglu_gate_up_kernel[grid](
        x_TD, g_ptr, gs_ptr, gs2_ptr, u_ptr, us_ptr, us2_ptr, rw, h, sorted_ids, tile_expert,
        R, I, D, E, float(swiglu_limit), x_TD.stride(0), x_TD.stride(1), *g_str, *gs_str, *u_str, *us_str,
        h.stride(0), h.stride(1),
        TOPK=K, FMT_G=g_fmt, FMT_U=u_fmt, FP32_DOT=INTERPRET or x_TD.dtype == torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=GATE_UP_N, BLOCK_K=GATE_UP_K,
        num_warps=GATE_UP_WARPS_NVFP4 if g_fp4 or u_fp4 else GATE_UP_WARPS, num_stages=NUM_STAGES)
    return h, (sorted_ids, tile_expert, n_tiles)


def swiglu_down_triton(h, plan, down, topk_ids_TK: torch.Tensor) -> torch.Tensor:
    """The down half of :func:`swiglu_expert_outputs_triton`: fp32 ``[T*K, D]`` rows ``fp32(h w2_e^T)`` from
    :func:`swiglu_hidden_triton`'s ``(h, plan)`` (``h`` None: zeros, or empty when there are no rows).

    Raises:
        ValueError: devices do not match.
    """
    T, K = topk_ids_TK.shape
    R = T * K
    E, D, I = down.shape
    y = torch.empty(R, D, dtype=torch.float32, device=topk_ids_TK.device)
    if h is None:
        return y.zero_() if R and D else y
    check_device("swiglu_expert_outputs_triton", h, *_nvfp4_tensors(down))
    sorted_ids, tile_expert, n_tiles = plan
    _launch(h, down, y, sorted_ids, tile_expert, n_tiles, R, E, K, False, True, False, "down")
    return y


def swiglu_expert_outputs_triton(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                                 gate, up, down, swiglu_limit: float) -> torch.Tensor:
    """fp32 ``[T*K, D]``: row ``t*K + k`` = ``fp32(round_x(swiglu_L(x_t w1_e^T, x_t w3_e^T) * w_tk) w2_e^T)``,
    ``e = ids[t, k]`` (module doc); batch-invariant per row. :func:`swiglu_hidden_triton` then
    :func:`swiglu_down_triton`.

    Args:
        x_TD: ``[T, D]`` bf16 (or fp32) activations.
        topk_ids_TK: ``[T, K]`` integer expert ids in ``[0, E)`` (range checked by the dispatcher on CPU).
        topk_weights_TK: ``[T, K]`` routing weights (used in fp32).
        gate, up: ``[E, I, D]`` in ``x``'s dtype or stacked :class:`NVFP4Weight`; down: ``[E, D, I]``.
        swiglu_limit: ``L > 0``.

    Raises:
        ValueError: dtypes, shapes or devices do not match.
    """
    E, I, D = up.shape
    if tuple(down.shape) != (E, D, I):
        raise ValueError(f"swiglu_expert_outputs_triton: x {tuple(x_TD.shape)}, gate {list(gate.shape)}, up "
                         f"{list(up.shape)}, down {list(down.shape)} do not match")
    h, plan = swiglu_hidden_triton(x_TD, topk_ids_TK, topk_weights_TK, gate, up, swiglu_limit)
    return swiglu_down_triton(h, plan, down, topk_ids_TK)
