"""``compress_pool`` in Triton: per-channel softmax over the candidates and the weighted sum, fp32.

One program per tile of ``BLOCK_E`` entries x ``BLOCK_C`` channels; each element of the tile
is its own lane and the kernel never reduces across lanes, so a lane's bits depend only on
its own N scores and kv values (not on E, the tile it falls in or its place there). Three
passes over the candidates, each a loop ``n = 0, 1, ..., N-1`` in that fixed order (the
formula of :mod:`.cpu`):

1. ``m = max_n s_n`` (``m' = 0`` when all are ``-inf``);
2. ``den = sum_n exp(s_n - m')`` (``den' = 1`` when 0);
3. ``out = sum_n [s_n > -inf] exp(s_n - m') / den' * kv_n`` (a masked candidate's kv is
   loaded as 0 and never used).

No atomics, no split over N, no autotuning; the tile constants are fixed. The GPU's ``exp``
(and any fused multiply-add the compiler forms) is not the CPU path's, so GPU and CPU bits
may differ; each is batch-invariant and deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton._common import check_device
from .common import check_pool_args

BLOCK_E = 16
"""Entries per program."""
BLOCK_C = 64
"""Channels per program."""


@triton.jit
def _compress_pool_kernel(kv_ptr, s_ptr, out_ptr, E, N, C, skv_e, skv_n, skv_c, ss_e, ss_n, ss_c, so_e, so_c,
                          BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr):
    e = tl.program_id(0).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E).to(tl.int64)
    c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    mask = (e < E)[:, None] & (c < C)[None, :]
    s_base = s_ptr + e[:, None] * ss_e + c[None, :] * ss_c
    kv_base = kv_ptr + e[:, None] * skv_e + c[None, :] * skv_c
    neg_inf = float("-inf")

    m = tl.full((BLOCK_E, BLOCK_C), neg_inf, tl.float32)
    for n in range(0, N):
        s = tl.load(s_base + n * ss_n, mask=mask, other=neg_inf)
        m = tl.maximum(m, s, propagate_nan=tl.PropagateNan.ALL)
    m = tl.where(m == neg_inf, 0.0, m)

    den = tl.zeros((BLOCK_E, BLOCK_C), tl.float32)
    for n in range(0, N):
        s = tl.load(s_base + n * ss_n, mask=mask, other=neg_inf)
        den = den + tl.exp(s - m)
    den = tl.where(den == 0.0, 1.0, den)

    acc = tl.zeros((BLOCK_E, BLOCK_C), tl.float32)
    for n in range(0, N):
        s = tl.load(s_base + n * ss_n, mask=mask, other=neg_inf)
        valid = s != neg_inf
        kv = tl.load(kv_base + n * skv_n, mask=mask & valid, other=0.0)
        w = tl.exp(s - m) / den
        acc = acc + tl.where(valid, w * kv, 0.0)
    tl.store(out_ptr + e[:, None] * so_e + c[None, :] * so_c, acc, mask=mask)


def compress_pool_triton(kv_ENC: torch.Tensor, score_ENC: torch.Tensor) -> torch.Tensor:
    """Triton ``compress_pool`` (the formula of :func:`unified_models.ops.compressor.compress_pool`).

    Args:
        kv_ENC, score_ENC: ``[E, N, C]`` fp32 (any strides), N >= 1, on CUDA (or on the CPU
            under ``TRITON_INTERPRET=1``).

    Returns:
        ``[E, C]`` fp32; row ``e`` depends only on ``kv_ENC[e]`` and ``score_ENC[e]``.

    Raises:
        ValueError: wrong ranks/shapes/dtypes, ``N < 1``, or tensors on different devices / on
            the CPU without the interpreter.
    """
    E, N, C = check_pool_args("compress_pool_triton", kv_ENC, score_ENC)
    check_device("compress_pool_triton", kv_ENC, score_ENC)
    out = torch.empty((E, C), dtype=torch.float32, device=kv_ENC.device)
    if E == 0 or C == 0:
        return out
    grid = (triton.cdiv(E, BLOCK_E), triton.cdiv(C, BLOCK_C))
    _compress_pool_kernel[grid](kv_ENC, score_ENC, out, E, N, C, *kv_ENC.stride(), *score_ENC.stride(),
                                *out.stride(), BLOCK_E=BLOCK_E, BLOCK_C=BLOCK_C, num_warps=4)
    return out
