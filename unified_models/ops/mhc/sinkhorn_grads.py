"""Gradient of mHC's ``comb`` w.r.t. its logits: softmax, ``+ hc_eps``, Sinkhorn, backwards in one pass.

``comb = sinkhorn(softmax_rows(logits) + hc_eps)``: columns normalised first, then
``sinkhorn_iters - 1`` times rows and columns, each step ``c / (sum + hc_eps)``
(:func:`.reference.hc_pre_math`; transformers ``DeepseekV4HyperConnection``). Autograd of that loop
is ~8 kernels per step, ~320 per ``hc_pre`` backward at 20 iterations (``HCRecomputeFnBackward`` in
``benchmarks/trainer_cost.py --profile``), each over a ``[T, n, n]`` tensor: launch-bound on a GPU.
Here the whole chain runs per token in registers (:func:`_sinkhorn_grad_kernel`: one program per
``BLOCK_T`` tokens; each step's input kept in an fp32 scratch ``[steps, T, n, n]``, then the steps
reversed), or on the CPU as the same formulas over all tokens at once (:func:`sinkhorn_grad_torch`).

Per step ``out = c / s`` (``s`` the row or column sums plus ``hc_eps``, broadcast):
``dc = (g - sum(g * out)) / s`` over the same axis; the softmax's ``dx = p (g - sum_k g_k p_k)``.
fp32; every token's row independent, no atomics (deterministic; not the forward's bits, which the
backward never needs). Checked against fp64 autograd of the formula in ``tests/ops/test_mhc_backward.py``.

Shapes: T tokens, n streams, logits and gradients ``[T, n, n]`` (row j, column k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._dispatch import use_triton
from ..triton._common import check_device, next_pow2

__all__ = ["sinkhorn_grad", "sinkhorn_grad_torch"]


def sinkhorn_grad_torch(logits_TNN: torch.Tensor, g_TNN: torch.Tensor, hc_eps: float,
                        sinkhorn_iters: int) -> torch.Tensor:
    """:func:`sinkhorn_grad` in torch (fp32, or fp64 for fp64 inputs): the forward chain with each step's
    sums and output kept, then the steps reversed; ~4 ops per step over all tokens."""
    p = torch.softmax(logits_TNN, dim=-1)
    c = p + hc_eps
    steps = []  # (dim, sums + eps, output) of each normalisation
    for step in range(2 * sinkhorn_iters - 1):
        dim = -2 if step % 2 == 0 else -1
        s = c.sum(dim=dim, keepdim=True) + hc_eps
        c = c / s
        steps.append((dim, s, c))
    g = g_TNN
    for dim, s, out in reversed(steps):
        g = (g - (g * out).sum(dim=dim, keepdim=True)) / s
    return p * (g - (g * p).sum(dim=-1, keepdim=True))


@triton.jit
def _col_sums(x):
    return tl.sum(x, axis=1)[:, None, :]


@triton.jit
def _row_sums(x):
    return tl.sum(x, axis=2)[:, :, None]


@triton.jit(do_not_specialize=["T"])
def _sinkhorn_grad_kernel(logit_ptr, g_ptr, out_ptr, scratch_ptr, T, hc_eps,
                          N: tl.constexpr, NP: tl.constexpr, STEPS: tl.constexpr, BLOCK_T: tl.constexpr):
    """``out[t] = d comb / d logits`` applied to ``g[t]`` for ``BLOCK_T`` tokens (row-major ``[T, N, N]``
    fp32 tensors; ``scratch``: ``[STEPS, T, N, N]`` fp32, each step's input)."""
    pid = tl.program_id(0)
    plane = T.to(tl.int64) * (N * N)  # one step's scratch (int64: steps x T x n^2 may pass 2^31)
    offs_t = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    jj = tl.arange(0, NP)[None, :, None]
    kk = tl.arange(0, NP)[None, None, :]
    valid = (offs_t[:, None, None] < T) & (jj < N) & (kk < N)
    off = offs_t[:, None, None] * (N * N) + jj * N + kk
    x = tl.load(logit_ptr + off, mask=valid, other=float("-inf"))
    x = tl.where(kk < N, x, float("-inf"))
    mx = tl.max(x, axis=2)[:, :, None]
    mx = tl.where(mx == float("-inf"), 0.0, mx)  # padding rows: all -inf
    e = tl.where(valid, tl.exp(x - mx), 0.0)
    den = _row_sums(e)
    p = e / tl.where(den > 0, den, 1.0)
    c = tl.where(valid, p + hc_eps, 0.0)
    for step in tl.static_range(STEPS):
        tl.store(scratch_ptr + step * plane + off, c, mask=valid)
        if step % 2 == 0:
            s = _col_sums(c) + hc_eps
        else:
            s = _row_sums(c) + hc_eps
        c = tl.where(valid, c / s, 0.0)
    g = tl.load(g_ptr + off, mask=valid, other=0.0)
    for step in tl.static_range(STEPS - 1, -1, -1):
        c_in = tl.load(scratch_ptr + step * plane + off, mask=valid, other=0.0)
        if step % 2 == 0:
            s = _col_sums(c_in) + hc_eps
            g = (g - _col_sums(g * (c_in / s))) / s
        else:
            s = _row_sums(c_in) + hc_eps
            g = (g - _row_sums(g * (c_in / s))) / s
        g = tl.where(valid, g, 0.0)
    dx = p * (g - _row_sums(g * p))
    tl.store(out_ptr + off, dx, mask=valid)


SINKHORN_GRAD_T = 32
"""Tokens per program of :func:`_sinkhorn_grad_kernel`."""


def sinkhorn_grad_triton(logits_TNN: torch.Tensor, g_TNN: torch.Tensor, hc_eps: float,
                         sinkhorn_iters: int) -> torch.Tensor:
    """:func:`sinkhorn_grad` through :func:`_sinkhorn_grad_kernel` (fp32 in and out)."""
    check_device("sinkhorn_grad", logits_TNN, g_TNN)
    t, n, _ = logits_TNN.shape
    steps = 2 * sinkhorn_iters - 1
    lg, gg = (x.float().contiguous() for x in (logits_TNN, g_TNN))
    out = torch.empty_like(lg)
    if t == 0:
        return out
    scratch = torch.empty((steps, t, n, n), dtype=torch.float32, device=lg.device)
    _sinkhorn_grad_kernel[(triton.cdiv(t, SINKHORN_GRAD_T),)](
        lg, gg, out, scratch, t, float(hc_eps), N=n, NP=next_pow2(n), STEPS=steps, BLOCK_T=SINKHORN_GRAD_T)
    return out


def sinkhorn_grad(logits_TNN: torch.Tensor, g_TNN: torch.Tensor, *, hc_eps: float,
                  sinkhorn_iters: int) -> torch.Tensor:
    """Gradient of ``comb = sinkhorn(softmax_rows(logits) + hc_eps)`` w.r.t. the logits, given ``g = dL/d comb``.

    Args:
        logits_TNN: ``[T, n, n]`` the comb logits (``mix[2n:] scale[2] + base[2n:]``, row j, column k), fp32
            (fp64 on the CPU path).
        g_TNN: ``[T, n, n]`` the gradient w.r.t. ``comb``, same dtype.
        hc_eps: config ``hc_eps``; sinkhorn_iters: config ``hc_sinkhorn_iters`` (>= 1).

    Returns:
        ``[T, n, n]`` ``dL/d logits``: fp32 (fp64 for fp64 inputs on the CPU path).

    Raises:
        ValueError: shapes differ or are not ``[T, n, n]``, ``sinkhorn_iters < 1``, or (Triton path: CUDA, or
            ``UM_OPS_BACKEND=triton``) tensors on different devices.
    """
    if logits_TNN.dim() != 3 or logits_TNN.shape[1] != logits_TNN.shape[2] or g_TNN.shape != logits_TNN.shape:
        raise ValueError(f"sinkhorn_grad: logits {tuple(logits_TNN.shape)} and gradient {tuple(g_TNN.shape)} "
                         "must both be [T, n, n]")
    if sinkhorn_iters < 1:
        raise ValueError(f"sinkhorn_grad: sinkhorn_iters must be >= 1, got {sinkhorn_iters}")
    if use_triton(logits_TNN) and logits_TNN.dtype != torch.float64:
        return sinkhorn_grad_triton(logits_TNN, g_TNN, hc_eps, sinkhorn_iters)
    return sinkhorn_grad_torch(logits_TNN, g_TNN, hc_eps, sinkhorn_iters)
