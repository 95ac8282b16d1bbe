"""fp64 oracle of ``compress_pool`` (differentiable plain torch, no NaN in value or gradient)."""

from __future__ import annotations

import torch


def compress_pool_reference(kv_ENC: torch.Tensor, score_ENC: torch.Tensor) -> torch.Tensor:
    """``pooled[e, c] = sum_n softmax_n(score[e, :, c])[n] kv[e, n, c]`` in fp64.

    Args:
        kv_ENC: ``[E, N, C]`` candidate kv rows (any float dtype; upcast to fp64).
        score_ENC: ``[E, N, C]`` their scores; ``-inf`` = no candidate (weight 0, kv unused).

    Returns:
        ``[E, C]`` fp64; 0 where all N scores of a channel are ``-inf``. Differentiable in
        both inputs (``torch.autograd``), with zero gradients at the ``-inf`` candidates and
        at empty entries.

    Source: transformers 5.19 ``DeepseekV4CSACompressor.forward`` (softmax over the
    candidate axis, weighted sum), evaluated in fp64.
    """
    kv, s = kv_ENC.double(), score_ENC.double()
    valid = s != float("-inf")
    s0 = torch.where(valid, s, torch.zeros_like(s))
    m = torch.where(valid, s, torch.full_like(s, float("-inf"))).amax(dim=1, keepdim=True).detach()
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    e = torch.where(valid, torch.exp(s0 - m), torch.zeros_like(s))
    den = e.sum(dim=1, keepdim=True)
    w = e / torch.where(den > 0, den, torch.ones_like(den))
    return (w * torch.where(valid, kv, torch.zeros_like(kv))).sum(dim=1)
