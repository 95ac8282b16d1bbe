"""Backward of ``compress_pool``: the autograd function (analytic) and the differentiable
``compress_pool`` that :mod:`unified_models.ops` exports.

With ``w = softmax_n(s)`` per channel and ``y = sum_n w_n kv_n``, for an upstream ``g = dL/dy``:
``dL/dkv_n = w_n g`` and ``dL/ds_n = w_n (g kv_n - sum_k w_k g kv_k) = w_n g (kv_n - y)``
(the softmax Jacobian ``dw_k/ds_n = w_k (delta_kn - w_n)``). The gradients are zero at the
``-inf`` candidates (weight 0; their kv is not used, even if NaN) and for empty entries.
Computed in fp32 (fp64 for fp64 inputs of :func:`compress_pool_grads`) with plain torch:
correct and deterministic, not batch-invariant (``docs/consistency.md``, "Gradients"). No
weight is involved (kv and score are activations), so no weight-version stamp.
"""

from __future__ import annotations

import torch

from ..grad.helpers import _cast, acc, needs_grad
from . import dispatch


def compress_pool_grads(kv_ENC: torch.Tensor, score_ENC: torch.Tensor, g_EC: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dL/dkv, dL/dscore)`` of ``compress_pool`` at ``(kv, score)`` for the upstream ``g``.

    Args:
        kv_ENC, score_ENC: ``[E, N, C]`` the forward's inputs; g_EC: ``[E, C]`` upstream gradient.

    Returns:
        Two ``[E, N, C]`` tensors in the accumulation dtype (fp64 for fp64 inputs, else fp32):
        ``dkv = w g``, ``dscore = w (g kv - sum_n w g kv)``; zero where ``score = -inf``.
    """
    kv, s, g = acc(kv_ENC), acc(score_ENC), acc(g_EC).unsqueeze(1)
    valid = s != float("-inf")
    zero = torch.zeros((), dtype=s.dtype, device=s.device)
    m = torch.where(valid, s, float("-inf")).amax(dim=1, keepdim=True)
    m = torch.where(m == float("-inf"), zero, m)
    e = torch.where(valid, torch.exp(torch.where(valid, s, zero) - m), zero)
    den = e.sum(dim=1, keepdim=True)
    w = e / torch.where(den > 0, den, torch.ones_like(den))
    t = torch.where(valid, g * kv, zero)  # g kv_n, 0 at masked candidates (their kv is never read)
    dkv = w * g
    ds = torch.where(valid, w * (t - (w * t).sum(dim=1, keepdim=True)), zero)
    return dkv, ds


class CompressPoolFn(torch.autograd.Function):
    """Forward: :func:`dispatch.compress_pool` (bitwise the op's values); backward:
    :func:`compress_pool_grads` (analytic, fp32), cast to each input's dtype."""

    @staticmethod
    def forward(ctx, kv_ENC, score_ENC):
        y = dispatch.compress_pool(kv_ENC, score_ENC)
        ctx.save_for_backward(kv_ENC, score_ENC)
        return y

    @staticmethod
    def backward(ctx, g_EC):
        kv, s = ctx.saved_tensors
        dkv, ds = compress_pool_grads(kv, s, g_EC)
        need_kv, need_s = ctx.needs_input_grad[:2]
        return (_cast(dkv, kv) if need_kv else None), (_cast(ds, s) if need_s else None)


def compress_pool(kv_ENC: torch.Tensor, score_ENC: torch.Tensor) -> torch.Tensor:
    """:func:`ops.compressor.compress_pool`, differentiable w.r.t. ``kv_ENC`` and ``score_ENC``.

    ``[E, N, C]`` fp32 kv and scores -> ``[E, C]`` fp32, the same bits with and without a
    graph. Raises as the op (``ValueError`` on shapes, dtypes, devices).
    """
    if needs_grad(kv_ENC, score_ENC):
        return CompressPoolFn.apply(kv_ENC, score_ENC)
    return dispatch.compress_pool(kv_ENC, score_ENC)
