"""The softmax router's selection (Qwen3-MoE) in Triton.

One program takes a tile of ``BLOCK_T`` tokens with all ``E`` experts in registers
(``BLOCK_T`` a function of ``E`` only, :func:`.deepseek_triton.router_block_t`) and computes, per
row, the package doc of :mod:`.softmax`: ``m = max(l)`` (exact), ``e = exp(l - m)``,
``p = div_rn(e, sum(e))`` (the sum's tree order is fixed by ``BLOCK_E``, a function of ``E``);
top-k of ``p`` as the package's total order (int64 key ``(ordered int32 image of p) << 32 |
(E - 1 - e)``, the row max taken ``K`` times, each winner masked out: ties to the lower expert
index, slots best first); weights ``p[ids]``, divided by ``((0 + w_0) + ... + w_{K-1}) + 1e-20``
when ``norm_topk_prob``.

Under the interpreter (CPU) ``exp`` and the sum are numpy's; on the GPU ``tl.exp`` is the
hardware's approximate exponential: other bits than the CPU path, the same bits for every row of
every batch. Tolerances against the fp64 oracle: ``tests/ops/test_softmax_router.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton._common import check_device, next_pow2
from .deepseek_triton import _INT64_MIN, ROUTER_WARPS, router_block_t


@triton.jit(do_not_specialize=["T"])
def _softmax_select_kernel(logits_ptr, w_ptr, ids_ptr, T, E, stride_lt, stride_le, stride_wt, stride_it,
                           TOPK: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_E: tl.constexpr):
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    cols = tl.arange(0, BLOCK_E)
    mask_e = cols < E
    mask = mask_t[:, None] & mask_e[None, :]
    lg = tl.load(logits_ptr + offs_t[:, None] * stride_lt + cols[None, :] * stride_le, mask=mask,
                 other=float("-inf")).to(tl.float32)
    lg = tl.where(mask_e[None, :], lg, float("-inf"))
    m = tl.max(lg, axis=1)
    m = tl.where(mask_t, m, 0.0)  # padding rows: no -inf - -inf
    ex = tl.exp(lg - m[:, None])
    ex = tl.where(mask_e[None, :], ex, 0.0)
    total = tl.where(mask_t, tl.sum(ex, axis=1), 1.0)  # padding rows: no 0 / 0
    s = tl.math.div_rn(ex, total[:, None])
    c = tl.where(s == 0.0, 0.0, s)  # -0.0 == +0.0
    bits = c.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    key = (ordered << 32) + (E - 1 - cols).to(tl.int64)[None, :]
    key = tl.where(mask_e[None, :], key, _INT64_MIN)
    slot = tl.arange(0, KP)
    wts = tl.zeros((BLOCK_T, KP), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, KP), dtype=tl.int32)
    den = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for k in tl.static_range(TOPK):
        best = tl.max(key, axis=1)
        hit = key == best[:, None]  # keys of a row are distinct: one hit
        e = E - 1 - best.to(tl.int32)  # low 32 bits (truncation): E - 1 - column
        wk = tl.sum(tl.where(hit, s, 0.0), axis=1)  # one nonzero term: exact
        key = tl.where(hit, _INT64_MIN, key)
        wts = tl.where(slot[None, :] == k, wk[:, None], wts)
        ids = tl.where(slot[None, :] == k, e[:, None], ids)
        den = den + wk
    if NORM:
        wts = tl.math.div_rn(wts, (den + 1e-20)[:, None])
    out_mask = mask_t[:, None] & (slot < TOPK)[None, :]
    tl.store(w_ptr + offs_t[:, None] * stride_wt + slot[None, :], wts, mask=out_mask)
    tl.store(ids_ptr + offs_t[:, None] * stride_it + slot[None, :], ids, mask=out_mask)


def softmax_select_triton(logits_TE: torch.Tensor, *, top_k: int, norm_topk_prob: bool
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router steps 2-4 of :mod:`.softmax` in one kernel (module doc).

    Args:
        logits_TE: fp32 ``[T, E]`` router logits (any strides). top_k: in ``[1, E]`` (checked by the caller).

    Returns:
        ``(weights_TK fp32, ids_TK int32)``, slots best first, ties to the lower expert index;
        row ``t`` depends only on ``logits_TE[t]``.

    Raises:
        ValueError: logits not fp32.
    """
    if logits_TE.dtype != torch.float32:
        raise ValueError(f"softmax_select_triton: logits must be fp32, got {logits_TE.dtype}")
    check_device("softmax_select_triton", logits_TE)
    T, E = logits_TE.shape
    w = torch.empty(T, top_k, dtype=torch.float32, device=logits_TE.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits_TE.device)
    if T == 0:
        return w, ids
    bt = router_block_t(E)
    _softmax_select_kernel[(triton.cdiv(T, bt),)](
        logits_TE, w, ids, T, E, logits_TE.stride(0), logits_TE.stride(1), w.stride(0), ids.stride(0),
        TOPK=top_k, KP=next_pow2(top_k), NORM=bool(norm_topk_prob), BLOCK_T=bt, BLOCK_E=next_pow2(E),
        num_warps=ROUTER_WARPS)
    return w, ids
