"""Backward of the FP8 W8A8 linear: ModelOpt's straight-through estimator (DESIGN.md rule 11).

The forward calls :func:`~.dispatch.fp8_linear_forward` (the kernels' bits, with or
without a graph); a master weight is quantized there by ModelOpt's rule on every call. The
backward differentiates the dequantized formula ``y = x_dq W_dq^T + b`` with

* ``x_dq = e4m3(x_q) * input_scale``, ``x_q`` = :func:`~unified_models.ops.fp8.fp8_quantize_activation`
  (recomputed: the same elementwise rule, so the same bits);
* ``W_dq = e4m3(w_q) * weight_scale``;

and the quantizers replaced by ModelOpt's STE (``tensor_quant._fake_tensor_quant_backward``:
pass ``dY`` where ``|input| <= amax``, zero elsewhere):

* ``dx = (dY W_dq) * [x not clamped]`` (:func:`~unified_models.ops.fp8.fp8_clamp_mask`);
* ``dW = dY^T x_dq``, handed to the master unchanged (the weight's ``amax`` is its own
  ``max |W|``, so ModelOpt's mask passes every element; the scale's dependence on ``W`` is
  not differentiated, as in ModelOpt);
* ``db = sum_t dY``.

Math in fp32 (fp64 when ``dY`` is fp64), each gradient cast once to its input's dtype. The
master weight and the bias are stamped (:mod:`unified_models.ops.grad.weights`): the backward raises
:class:`~unified_models.ops.grad.weights.StaleWeightError` if either changed since the forward.
Backwards are correct, not batch-invariant.

:func:`fp8_linear` (the differentiable entry point, exported as
``unified_models.ops.fp8_linear``) and the STE mask :func:`fp8_clamp_mask` are here too.
"""

from __future__ import annotations

import torch

from ..grad.helpers import acc, grad_matmul
from ..grad.weights import check_stamps, stamp
from .common import FP8_E4M3_MAX, FP8Weight, _scale, fp8_quantize_weight, fp8_weight_scale
from .dispatch import fp8_linear_forward, fp8_quantize_activation

__all__ = ["fp8_linear", "fp8_clamp_mask", "Fp8LinearFn"]


def fp8_clamp_mask(x: torch.Tensor, input_scale: torch.Tensor | float) -> torch.Tensor:
    """True where :func:`fp8_quantize_activation` does NOT clamp ``x`` (``|fp32(x) * inv| <= 448``;
    False for NaN): where the STE passes the gradient. ModelOpt's mask is ``|x| <= amax`` with
    ``amax = 448 * input_scale``; the two differ only within an fp32 ulp of ``amax``."""
    inv = torch.reciprocal(_scale(input_scale, x.device, "input_scale"))
    return (x.float() * inv).abs() <= FP8_E4M3_MAX


class Fp8LinearFn(torch.autograd.Function):
    """Inputs ``(x_TK, master_NK | None, bias_N | None, w_q | None, weight_scale | None,
    input_scale, out_dtype)``: with a master, ``w_q``/``weight_scale`` are derived here (and
    ``None`` on entry); with a fixed FP8 weight, ``master`` is ``None`` and gets no gradient."""

    @staticmethod
    def forward(ctx, x_TK, master_NK, bias_N, w_q, weight_scale, input_scale, out_dtype):
        if master_NK is not None:
            weight_scale = fp8_weight_scale(master_NK)
            w_q = fp8_quantize_weight(master_NK, weight_scale)
        y = fp8_linear_forward(x_TK, w_q, weight_scale, input_scale, bias_N, out_dtype)
        ctx.save_for_backward(x_TK, w_q, weight_scale, input_scale)
        ctx.master_dtype = master_NK.dtype if master_NK is not None else None
        ctx.bias_dtype = bias_N.dtype if bias_N is not None else None
        ctx.stamps = stamp(weight=master_NK, bias=bias_N)
        return y

    @staticmethod
    def backward(ctx, g_TN):
        check_stamps("fp8_linear", ctx.stamps)
        x, w_q, s_w, s_x = ctx.saved_tensors
        nx, nw, nb = ctx.needs_input_grad[:3]
        g = acc(g_TN)
        dt = g.dtype
        dx = dw = db = None
        if nx:
            w_dq = w_q.to(dt) * s_w.to(dt)
            dx = (grad_matmul(g_TN, w_dq) * fp8_clamp_mask(x, s_x)).to(x.dtype)
        if nw:
            x_dq = fp8_quantize_activation(x.detach(), s_x).to(dt) * s_x.to(dt)
            dw = grad_matmul(g_TN.t(), x_dq).to(ctx.master_dtype)
        if nb and ctx.bias_dtype is not None:
            db = g.sum(0).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, None


def fp8_linear(x_TK: torch.Tensor, weight: FP8Weight | torch.Tensor, input_scale: torch.Tensor | float | None = None,
               bias_N: torch.Tensor | None = None, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """FP8 W8A8 linear ``y = x W^T + b`` with ModelOpt per-tensor scales, differentiable (STE).

    Args:
        x_TK: ``[T, K]`` bf16/fp16/fp32 activations (any strides).
        weight: an :class:`FP8Weight` (the rollout, loaded from a ModelOpt checkpoint; no
            gradient), or a ``[N, K]`` bf16/fp16/fp32 master tensor, quantized on EVERY call by
            :func:`fp8_weight_scale` + :func:`fp8_quantize_weight` (the trainer; straight-through
            gradient to the master).
        input_scale: the static activation scale (one element, fp32); required with a master
            tensor, must be None with an :class:`FP8Weight` (which carries its own).
        bias_N: optional ``[N]`` (bf16/fp16/fp32), added before the final rounding.
        out_dtype: bf16/fp16/fp32, default ``x_TK.dtype``.

    Returns:
        ``[T, N]`` in ``out_dtype``: ``round(acc * fp32(input_scale * weight_scale) + bias)``
        (package doc). Row ``t`` depends only on ``x_TK[t]`` (bitwise).

    Raises:
        ValueError: shapes/dtypes do not match, ``input_scale`` missing or doubled.

    With grad mode on and ``x_TK``, a master ``weight`` or ``bias_N`` requiring grad the call
    goes through :class:`Fp8LinearFn` (same forward values; STE
    backward, see :mod:`unified_models.ops.fp8.backward`).
    """
    if isinstance(weight, FP8Weight):
        if input_scale is not None:
            raise ValueError("fp8_linear: an FP8Weight carries its input_scale; pass input_scale=None")
        master, wq, s_w, s_x = None, weight.weight, weight.weight_scale, weight.input_scale
    elif isinstance(weight, torch.Tensor):
        if input_scale is None:
            raise ValueError("fp8_linear: a master weight tensor needs the static input_scale")
        master, s_x = weight, _scale(input_scale, x_TK.device, "input_scale")
        wq = s_w = None
    else:
        raise TypeError(f"fp8_linear: weight must be an FP8Weight or a tensor, got {type(weight).__name__}")
    w_shape = (master if master is not None else wq).shape
    if x_TK.dim() != 2 or len(w_shape) != 2 or x_TK.shape[1] != w_shape[1]:
        raise ValueError(f"fp8_linear: x {list(x_TK.shape)} @ W^T {list(w_shape)} do not match")
    out_dtype = out_dtype or x_TK.dtype
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x_TK, master, bias_N)):
        return Fp8LinearFn.apply(x_TK, master, bias_N, wq, s_w, s_x, out_dtype)
    if master is not None:
        s_w = fp8_weight_scale(master)
        wq = fp8_quantize_weight(master, s_w)
    return fp8_linear_forward(x_TK, wq, s_w, s_x, bias_N, out_dtype)
