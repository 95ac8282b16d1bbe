"""CPU path of ``compress_pool``: fp32, every output element a fixed chain over the candidates.

The ``E x C`` outputs are independent *lanes*: lane ``(e, c)`` sees only
``score[e, :, c]`` and ``kv[e, :, c]``. The inputs are laid out as ``[N, E*C]`` (one
contiguous row of lanes per candidate) and every lane is computed by the same sequence of
elementwise IEEE operations, in candidate order ``n = 0, 1, ..., N-1``:

1. ``m = max(s_0, ..., s_{N-1})`` as a chain of ``torch.maximum`` (exact);
   ``m' = 0`` where ``m = -inf`` (an entry with no candidate), else ``m``;
2. ``x_n = s_n - m'`` (one rounding) and ``e_n = exp(x_n)`` (``exp(-inf) = 0``);
3. ``den = ((e_0 + e_1) + e_2) + ...`` (a chain of adds), ``den' = 1`` where ``den = 0``;
4. ``w_n = e_n / den'`` (one IEEE division);
5. ``pooled = ((t_0 + t_1) + t_2) + ...`` with ``t_n = w_n * kv_n``, or ``t_n = 0`` where
   ``s_n = -inf`` (so a masked candidate's kv, even NaN, is never used).

Additions, products, divisions and maxima are correctly rounded in every lane whatever the
vectorisation or the thread split, so only ``exp`` needs care: ATen may compute the tail of
a contiguous run with other code than its vectorised bulk, and splits runs above its grain
between threads at places that depend on the length (whether a lane's bits then change
depends on the build and the ISA; torch 2.13 on an AVX-512 host showed no difference over
10^6 values, but nothing promises it). So ``exp`` is called only on contiguous chunks of
exactly :data:`LANE_TILE` elements (a multiple of 64, below every ATen / VML grain: one
thread, no tail): every lane goes through the same vector code, so a lane's bits depend on
neither E, nor its place, nor the other lanes (batch-invariant by construction). Like the package's
other CPU reductions, they may differ between CPU ISAs (AVX2 vs AVX-512 exp kernels; pin
``ATEN_CPU_CAPABILITY``), never between rollout and trainer on one host.
"""

from __future__ import annotations

import torch

LANE_TILE = 1024
"""Elements per ``torch.exp`` call (a multiple of 64 and below ATen's grains)."""


def sum_chain_rows(x_NL: torch.Tensor) -> torch.Tensor:
    """``x[0] + x[1] + ... + x[N-1]`` left to right (elementwise adds, fixed order)."""
    acc = x_NL[0]
    for n in range(1, x_NL.shape[0]):
        acc = acc + x_NL[n]
    return acc


def exp_tiled(x: torch.Tensor) -> torch.Tensor:
    """``torch.exp`` of ``x`` (any shape, fp32) in contiguous chunks of :data:`LANE_TILE` elements.

    The flattened tensor is zero-padded to a multiple of the tile, so every element is computed
    by ATen's vectorised exp inside one single-threaded call of a fixed size.
    """
    flat = x.reshape(-1)
    n = flat.numel()
    pad = (-n) % LANE_TILE
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    out = torch.empty_like(flat)
    for i in range(0, flat.numel(), LANE_TILE):
        torch.exp(flat[i:i + LANE_TILE], out=out[i:i + LANE_TILE])
    return out[:n].view(x.shape)


def compress_pool_torch(kv_ENC: torch.Tensor, score_ENC: torch.Tensor) -> torch.Tensor:
    """CPU ``compress_pool``: ``[E, N, C]`` fp32 kv and scores -> ``[E, C]`` fp32 (see the module doc).

    The caller (:func:`unified_models.ops.compressor.dispatch.compress_pool`) checks the arguments.
    """
    E, N, C = kv_ENC.shape
    if E * C == 0:
        return kv_ENC.new_zeros((E, C))
    kv = kv_ENC.permute(1, 0, 2).reshape(N, E * C)
    s = score_ENC.permute(1, 0, 2).reshape(N, E * C)
    valid = s != float("-inf")
    m = s[0]
    for n in range(1, N):
        m = torch.maximum(m, s[n])
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    e = exp_tiled(s - m)
    den = sum_chain_rows(e)
    den = torch.where(den == 0, torch.ones_like(den), den)
    w = e / den
    t = torch.where(valid, w * kv, torch.zeros_like(w))
    return sum_chain_rows(t).view(E, C)
