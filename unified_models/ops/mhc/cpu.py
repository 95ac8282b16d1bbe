"""CPU path of mHC: fp32 math at transformers' rounding points, batch-invariant by construction.

* The mixing logits (:func:`hc_mixes_torch`): the unweighted RMS norm is the package's
  RMSNorm CPU path with a unit gain (``x * rsqrt(mean(x^2) + eps) * 1`` is ``x * rsqrt(...)``
  exactly) and the projection is the package's linear CPU path (fp64 dot products rounded
  once to fp32, fixed 16-row tiles): no BLAS call whose result depends on the row count.
* The coefficients (:func:`hc_coefficients_torch`) run over fixed row tiles whose element
  count is a multiple of 64 per tensor, so ATen's vectorised ``sigmoid`` / ``exp`` never
  leaves a scalar tail that a row would hit only at some places in the batch. Every sum
  over the stream axis (softmax, Sinkhorn, the collapse, the post's ``comb^T h``) is an
  explicit left-to-right chain of elementwise IEEE adds: fixed order, no reduction kernel.

Shapes: T tokens, n streams, D hidden, M = (2 + n) n mixing logits.
"""

from __future__ import annotations

import torch

from .._dispatch import ROW_TILE, map_row_tiles
from ..linear.cpu import linear_torch
from ..rmsnorm.cpu import rms_norm_torch

VECTOR_QUANTUM = 64
"""Elements per tile of each coefficient tensor are a multiple of this (>= 2 AVX-512 fp32 vectors)."""


def sum_chain(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x.sum(dim)`` as ``((x_0 + x_1) + x_2) + ...``: a fixed order of elementwise adds."""
    acc = x.select(dim, 0)
    for j in range(1, x.shape[dim]):
        acc = acc + x.select(dim, j)
    return acc


def hc_mixes_torch(streams_TND: torch.Tensor, fn_MK: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """fp32 ``[T, M]`` logits ``F.linear(rms(flatten(h).float()), fn.float())`` (K = n D)."""
    flat = streams_TND.reshape(streams_TND.shape[0], streams_TND.shape[1] * streams_TND.shape[2]).float()
    unit = torch.ones(flat.shape[1], dtype=torch.float32, device=flat.device)
    return linear_torch(rms_norm_torch(flat, unit, norm_eps, torch.float32), fn_MK.float(), None, torch.float32)


def _tile_rows(width: int) -> int:
    rows = ROW_TILE
    while (rows * width) % VECTOR_QUANTUM:
        rows *= 2
    return rows


def softmax_chain(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis: ``exp(x - max) / sum`` with :func:`sum_chain` (fp32 in, fp32 out)."""
    e = torch.exp(x - x.amax(dim=-1, keepdim=True))
    return e / sum_chain(e, -1).unsqueeze(-1)


def sinkhorn_chain(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """transformers' Sinkhorn on ``[..., n, n]``: columns, then ``iters - 1`` times rows and columns.

    Each step divides by ``sum + eps`` (``DeepseekV4HyperConnection.forward``).
    """
    comb = comb / (sum_chain(comb, -2).unsqueeze(-2) + eps)
    for _ in range(iters - 1):
        comb = comb / (sum_chain(comb, -1).unsqueeze(-1) + eps)
        comb = comb / (sum_chain(comb, -2).unsqueeze(-2) + eps)
    return comb


def hc_coefficients_torch(mixes_TM: torch.Tensor, base_M: torch.Tensor, scale_3: torch.Tensor, n: int,
                          hc_eps: float, sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``pre [T, n]``, ``post [T, n]``, ``comb [T, n, n]`` from the logits (see the op)."""
    base, scale = base_M.float(), scale_3.float()
    m = n * n

    def tile(mix):
        pre = torch.sigmoid(mix[:, :n].contiguous() * scale[0] + base[:n]) + hc_eps
        post = 2 * torch.sigmoid(mix[:, n:2 * n].contiguous() * scale[1] + base[n:2 * n])
        logits = (mix[:, 2 * n:].contiguous() * scale[2] + base[2 * n:]).view(-1, n, n)
        comb = sinkhorn_chain(softmax_chain(logits) + hc_eps, sinkhorn_iters, hc_eps)
        return torch.cat([pre, post, comb.reshape(-1, m)], dim=1)

    out = map_row_tiles(tile, mixes_TM, rows=_tile_rows(n))
    return out[:, :n], out[:, n:2 * n], out[:, 2 * n:].reshape(-1, n, n)


def collapse_torch(streams_TND: torch.Tensor, w_TN: torch.Tensor) -> torch.Tensor:
    """``sum_j w_j h_j`` in fp32 (products rounded to fp32, :func:`sum_chain`), rounded to h's dtype."""
    return sum_chain(w_TN.float().unsqueeze(-1) * streams_TND, 1).to(streams_TND.dtype)


def hc_pre_torch(streams_TND, fn_MK, base_M, scale_3, norm_eps, hc_eps, sinkhorn_iters):
    """CPU HC pre: ``(x [T, D] in h's dtype, post [T, n] fp32, comb [T, n, n] fp32)``."""
    n = streams_TND.shape[1]
    pre, post, comb = hc_coefficients_torch(hc_mixes_torch(streams_TND, fn_MK, norm_eps), base_M, scale_3, n,
                                            hc_eps, sinkhorn_iters)
    return collapse_torch(streams_TND, pre), post, comb


def hc_post_torch(streams_TND, y_TD, post_TN, comb_TNN):
    """CPU HC post: ``round(round(post) y) + round(sum_j round(comb[j, k]) h_j)`` in h's dtype.

    The roundings are transformers' (``post.to(dtype) * y``, ``matmul(comb.to(dtype)^T, h)``
    and their sum in the model dtype); the ``comb^T h`` accumulation is fp32, in stream order.
    """
    dt = streams_TND.dtype
    expand = post_TN.to(dt).unsqueeze(-1) * y_TD.unsqueeze(1)
    comb = comb_TNN.to(dt).float()
    mixed = sum_chain(comb.unsqueeze(-1) * streams_TND.float().unsqueeze(2), 1).to(dt)  # [T, j, k, D] -> [T, k, D]
    return expand + mixed


def hc_head_torch(streams_TND, fn_NK, base_N, scale_1, norm_eps, hc_eps):
    """CPU hc_head: ``sum_j (sigmoid(mix_j scale + base_j) + eps) h_j`` in h's dtype."""
    mixes = hc_mixes_torch(streams_TND, fn_NK, norm_eps)
    base, scale = base_N.float(), scale_1.float()

    def tile(mix):
        return torch.sigmoid(mix * scale[0] + base) + hc_eps

    pre = map_row_tiles(tile, mixes, rows=_tile_rows(streams_TND.shape[1]))
    return collapse_torch(streams_TND, pre)
