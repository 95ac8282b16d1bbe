"""The mHC formulas in plain differentiable torch, and the fp64 oracle built on them.

``*_math`` compute in the dtype of their inputs with no intermediate rounding (torch's own
``sum`` / ``softmax`` / ``matmul``): the backward (:mod:`.backward`) differentiates them at
fp32 (fp64 for fp64 inputs); ``*_reference`` are the fp64 oracle (inputs upcast, results in
the streams' dtype, or fp32 for ``post`` / ``comb``). Source: transformers 5.19
``models/deepseek_v4/modeling_deepseek_v4.py``: ``DeepseekV4UnweightedRMSNorm``,
``DeepseekV4HyperConnection.forward``, ``DeepseekV4HyperHead.forward`` and the post in
``DeepseekV4DecoderLayer.forward``.

Shapes: T tokens, n streams, D hidden, M = (2 + n) n.
"""

from __future__ import annotations

import torch


def _normed_flat(streams_TND: torch.Tensor, norm_eps: float) -> torch.Tensor:
    flat = streams_TND.reshape(streams_TND.shape[0], streams_TND.shape[1] * streams_TND.shape[2])
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)


def hc_pre_math(streams_TND, fn_MK, base_M, scale_3, norm_eps, hc_eps, sinkhorn_iters):
    """``(x [T, D], post [T, n], comb [T, n, n])`` of ``DeepseekV4HyperConnection``, unrounded."""
    n = streams_TND.shape[1]
    mixes = _normed_flat(streams_TND, norm_eps) @ fn_MK.t()
    pre = torch.sigmoid(mixes[:, :n] * scale_3[0] + base_M[:n]) + hc_eps
    post = 2 * torch.sigmoid(mixes[:, n:2 * n] * scale_3[1] + base_M[n:2 * n])
    logits = (mixes[:, 2 * n:] * scale_3[2] + base_M[2 * n:]).view(-1, n, n)
    comb = torch.softmax(logits, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return (pre.unsqueeze(-1) * streams_TND).sum(dim=1), post, comb


def hc_post_math(streams_TND, y_TD, post_TN, comb_TNN):
    """``h'_k = post_k y + sum_j comb[j, k] h_j`` (``post ⊗ y + comb^T h``), unrounded."""
    return post_TN.unsqueeze(-1) * y_TD.unsqueeze(1) + comb_TNN.transpose(-1, -2) @ streams_TND


def hc_head_math(streams_TND, fn_NK, base_N, scale_1, norm_eps, hc_eps):
    """``sum_j (sigmoid(mix_j scale + base_j) + eps) h_j`` of ``DeepseekV4HyperHead``, unrounded."""
    pre = torch.sigmoid((_normed_flat(streams_TND, norm_eps) @ fn_NK.t()) * scale_1[0] + base_N) + hc_eps
    return (pre.unsqueeze(-1) * streams_TND).sum(dim=1)


def hc_pre_reference(streams_TND, fn_MK, base_M, scale_3, *, norm_eps, hc_eps, sinkhorn_iters):
    """fp64 oracle of :func:`unified_models.ops.mhc.hc_pre`: x in the streams' dtype, post / comb fp32
    (fp64 for fp64 streams)."""
    x, post, comb = hc_pre_math(*(t.double() for t in (streams_TND, fn_MK, base_M, scale_3)), norm_eps, hc_eps,
                                sinkhorn_iters)
    coef = torch.float64 if streams_TND.dtype == torch.float64 else torch.float32
    return x.to(streams_TND.dtype), post.to(coef), comb.to(coef)


def hc_post_reference(streams_TND, y_TD, post_TN, comb_TNN):
    """fp64 oracle of :func:`unified_models.ops.mhc.hc_post` (one rounding to the streams' dtype)."""
    return hc_post_math(*(t.double() for t in (streams_TND, y_TD, post_TN, comb_TNN))).to(streams_TND.dtype)


def hc_head_reference(streams_TND, fn_NK, base_N, scale_1, *, norm_eps, hc_eps):
    """fp64 oracle of :func:`unified_models.ops.mhc.hc_head` (one rounding to the streams' dtype)."""
    return hc_head_math(*(t.double() for t in (streams_TND, fn_NK, base_N, scale_1)), norm_eps,
                        hc_eps).to(streams_TND.dtype)
