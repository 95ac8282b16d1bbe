"""Autograd functions of the row-wise ops: forward from the shared kernels, analytic backward.

Every ``forward`` calls the op's public dispatching function (Triton on GPU,
the batch-invariant torch implementation on CPU) with grad mode off, so the
values are the kernels' bits with or without a graph. Every ``backward`` is
plain torch in fp32 (fp64 for fp64 inputs), cast once to the input's dtype;
roundings of the forward (bf16 outputs) pass gradients straight through.
Backwards are correct, not batch-invariant (DESIGN.md rule 11).

Shapes: T tokens, K/N linear in/out features, D hidden, V vocabulary, H heads,
E head dim, P positions, R = rotary dim.
"""

from __future__ import annotations

import torch

from . import kernels as _ops
from .weights import check_stamps, stamp


def acc(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the backward's accumulation dtype: fp64 stays fp64, else fp32."""
    return t.double() if t.dtype == torch.float64 else t.float()


def _cast(g: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return None if g is None or like is None else g.to(like.dtype)


class LinearFn(torch.autograd.Function):
    """``y = x W^T + b``: ``dX = dY W``, ``dW = dY^T X``, ``db = sum_t dY``."""

    @staticmethod
    def forward(ctx, x_TK, weight_NK, bias_N, out_dtype):
        y = _ops.linear(x_TK, weight_NK, bias_N, out_dtype)
        ctx.save_for_backward(x_TK if ctx.needs_input_grad[1] else None)
        ctx.x_dtype, ctx.weight, ctx.bias = x_TK.dtype, weight_NK, bias_N
        ctx.stamps = stamp(weight=weight_NK, bias=bias_N)
        return y

    @staticmethod
    def backward(ctx, g_TN):
        check_stamps("linear", ctx.stamps)
        (x,) = ctx.saved_tensors
        w, b = ctx.weight, ctx.bias
        g = acc(g_TN)
        dx = (g @ acc(w)).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        dw = (g.t() @ acc(x)).to(w.dtype) if ctx.needs_input_grad[1] else None
        db = g.sum(0).to(b.dtype) if b is not None and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


class EmbeddingFn(torch.autograd.Function):
    """``out[t] = W[ids[t]]``: ``dW = index_add(ids, dOut)`` (repeated ids accumulate)."""

    @staticmethod
    def forward(ctx, input_ids_T, weight_VD):
        out = _ops.embedding(input_ids_T, weight_VD)
        ctx.save_for_backward(input_ids_T)
        ctx.weight = weight_VD
        ctx.stamps = stamp(weight=weight_VD)
        return out

    @staticmethod
    def backward(ctx, g_TD):
        check_stamps("embedding", ctx.stamps)
        (ids,) = ctx.saved_tensors
        w = ctx.weight
        g = acc(g_TD)
        dw = torch.zeros(w.shape, dtype=g.dtype, device=g.device).index_add_(0, ids.long(), g)
        return None, dw.to(w.dtype)


class RMSNormFn(torch.autograd.Function):
    """``y = x r w`` with ``r = (mean(x^2) + eps)^-1/2``, ``x^ = x r``:
    ``dw = sum_t dy x^``, ``dx = r (dy w - x^ mean(dy w x^))``."""

    @staticmethod
    def forward(ctx, x_TD, weight_D, eps, out_dtype):
        y = _ops.rms_norm(x_TD, weight_D, eps, out_dtype)
        ctx.save_for_backward(x_TD)
        ctx.weight, ctx.eps = weight_D, eps
        ctx.stamps = stamp(weight=weight_D)
        return y

    @staticmethod
    def backward(ctx, g_TD):
        check_stamps("rms_norm", ctx.stamps)
        (x_in,) = ctx.saved_tensors
        w = ctx.weight
        x, g = acc(x_in), acc(g_TD)
        r = torch.rsqrt(x.square().mean(-1, keepdim=True) + ctx.eps)
        xhat = x * r
        gw = g * acc(w)
        dx = r * (gw - xhat * (gw * xhat).mean(-1, keepdim=True)) if ctx.needs_input_grad[0] else None
        dw = (g * xhat).sum(0) if ctx.needs_input_grad[1] else None
        return _cast(dx, x_in), _cast(dw, w), None, None


class Relu2Fn(torch.autograd.Function):
    """``y = relu(x)^2``: ``dx = 2 relu(x) dy``."""

    @staticmethod
    def forward(ctx, x_TF):
        ctx.save_for_backward(x_TF)
        return _ops.relu2(x_TF)

    @staticmethod
    def backward(ctx, g_TF):
        (x,) = ctx.saved_tensors
        return (2.0 * torch.relu(acc(x)) * acc(g_TF)).to(x.dtype)


class SwigluFn(torch.autograd.Function):
    """``y = silu(g) u`` with ``s = sigmoid(g)``: ``du = dy g s``, ``dg = dy u s (1 + g (1 - s))``."""

    @staticmethod
    def forward(ctx, gate_TF, up_TF):
        out = _ops.swiglu(gate_TF, up_TF)
        ctx.save_for_backward(gate_TF, up_TF)
        return out

    @staticmethod
    def backward(ctx, g_TF):
        gate_in, up_in = ctx.saved_tensors
        gate, up, g = acc(gate_in), acc(up_in), acc(g_TF)
        s = torch.sigmoid(gate)
        dgate = g * up * s * (1.0 + gate * (1.0 - s)) if ctx.needs_input_grad[0] else None
        dup = g * gate * s if ctx.needs_input_grad[1] else None
        return _cast(dgate, gate_in), _cast(dup, up_in)


class RopeFn(torch.autograd.Function):
    """Rotation by the position's angles; the backward rotates by the opposite angles:
    ``dx1 = dy1 cos + dy2 sin``, ``dx2 = dy2 cos - dy1 sin``, other dims pass through.
    The cos/sin tables are constants (no gradient)."""

    @staticmethod
    def forward(ctx, x_THE, positions_T, cos_PR, sin_PR):
        out = _ops.apply_rope(x_THE, positions_T, cos_PR, sin_PR)
        ctx.save_for_backward(positions_T, cos_PR, sin_PR)
        ctx.x_dtype = x_THE.dtype
        return out

    @staticmethod
    def backward(ctx, g_THE):
        pos, cos, sin = ctx.saved_tensors
        half = cos.shape[1]
        g = acc(g_THE)
        c = acc(cos).index_select(0, pos.long())[:, None, :]
        s = acc(sin).index_select(0, pos.long())[:, None, :]
        g1, g2 = g[..., :half], g[..., half:2 * half]
        dx = torch.cat([g1 * c + g2 * s, g2 * c - g1 * s, g[..., 2 * half:]], dim=-1)
        return dx.to(ctx.x_dtype), None, None, None


class LogprobsFn(torch.autograd.Function):
    """``y = log_softmax(z / T)``: ``dz = (dy - softmax * sum(dy)) / T`` (softmax = exp(y))."""

    @staticmethod
    def forward(ctx, logits_TV, temperature):
        y = _ops.logprobs(logits_TV, temperature)
        ctx.save_for_backward(y)
        ctx.temperature, ctx.z_dtype = temperature, logits_TV.dtype
        return y

    @staticmethod
    def backward(ctx, g_TV):
        (y,) = ctx.saved_tensors
        g = acc(g_TV)
        dz = (g - torch.exp(acc(y)) * g.sum(-1, keepdim=True)) / ctx.temperature
        return dz.to(ctx.z_dtype), None


class GatherTokenFn(torch.autograd.Function):
    """``y[t] = lp[t, ids[t]]``: ``dlp`` is ``dy`` scattered to column ``ids[t]`` of row t."""

    @staticmethod
    def forward(ctx, logprobs_TV, token_ids_T):
        ctx.save_for_backward(token_ids_T)
        ctx.shape, ctx.lp_dtype = logprobs_TV.shape, logprobs_TV.dtype
        return _ops.gather_token_logprobs(logprobs_TV, token_ids_T)

    @staticmethod
    def backward(ctx, g_T):
        (ids,) = ctx.saved_tensors
        d = torch.zeros(ctx.shape, dtype=ctx.lp_dtype, device=g_T.device)
        return d.scatter_(1, ids.long().view(-1, 1), g_T.to(ctx.lp_dtype).view(-1, 1)), None
