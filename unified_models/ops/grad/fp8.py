"""Backward of the FP8 W8A8 linear: ModelOpt's straight-through estimator (DESIGN.md rule 11).

The forward calls :func:`unified_models.ops.fp8.fp8_linear_forward` (the kernels' bits, with or
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
master weight and the bias are stamped (:mod:`.weights`): the backward raises
:class:`~unified_models.ops.grad.weights.StaleWeightError` if either changed since the forward.
Backwards are correct, not batch-invariant.
"""

from __future__ import annotations

import torch

from .. import fp8 as _fp8
from .functions import acc
from .weights import check_stamps, stamp

__all__ = ["Fp8LinearFn"]


class Fp8LinearFn(torch.autograd.Function):
    """Inputs ``(x_TK, master_NK | None, bias_N | None, w_q | None, weight_scale | None,
    input_scale, out_dtype)``: with a master, ``w_q``/``weight_scale`` are derived here (and
    ``None`` on entry); with a fixed FP8 weight, ``master`` is ``None`` and gets no gradient."""

    @staticmethod
    def forward(ctx, x_TK, master_NK, bias_N, w_q, weight_scale, input_scale, out_dtype):
        if master_NK is not None:
            weight_scale = _fp8.fp8_weight_scale(master_NK)
            w_q = _fp8.fp8_quantize_weight(master_NK, weight_scale)
        y = _fp8.fp8_linear_forward(x_TK, w_q, weight_scale, input_scale, bias_N, out_dtype)
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
            dx = ((g @ w_dq) * _fp8.fp8_clamp_mask(x, s_x)).to(x.dtype)
        if nw:
            x_dq = _fp8.fp8_quantize_activation(x.detach(), s_x).to(dt) * s_x.to(dt)
            dw = (g.t() @ x_dq).to(ctx.master_dtype)
        if nb and ctx.bias_dtype is not None:
            db = g.sum(0).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, None
