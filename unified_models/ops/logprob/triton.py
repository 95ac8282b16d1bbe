"""Log-probabilities in Triton: ``log_softmax(logits.float() / temperature)`` over V.

One program per row, two passes over fixed ``BLOCK_V`` chunks in increasing
order: pass 1 keeps a running (max, sum of exp) pair, pass 2 writes
``x - (max + log(sum))``. The reduction order depends only on ``V``. The
temperature division is IEEE round-to-nearest fp32 division
(``tl.math.div_rn``; Triton's ``/`` on fp32 is an approximate division on
GPU), i.e. the same as ``logits.float() / temperature`` in torch with the
temperature as an fp32 scalar.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton._common import INTERPRET, check_device

if INTERPRET:
    BLOCK_V, NUM_WARPS = 1024, 4
else:
    BLOCK_V, NUM_WARPS = 4096, 8

_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _logprobs_kernel(x_ptr, out_ptr, V, temperature, stride_xt, stride_xv, stride_ot, stride_ov,
                     BLOCK_V: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + t * stride_xt
    o_row = out_ptr + t * stride_ot
    cols = tl.arange(0, BLOCK_V)
    m = float("-inf")
    s = 0.0
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        mask = c < V
        x = tl.load(x_row + c * stride_xv, mask=mask, other=0.0).to(tl.float32)
        x = tl.math.div_rn(x, temperature)
        x = tl.where(mask, x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # Shift by 0 while every logit so far is -inf (avoids -inf - -inf = NaN).
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(x - m_ref), axis=0)
        m = m_new
    lse = m + tl.log(s)
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        mask = c < V
        x = tl.load(x_row + c * stride_xv, mask=mask, other=0.0).to(tl.float32)
        x = tl.math.div_rn(x, temperature)
        tl.store(o_row + c * stride_ov, x - lse, mask=mask)


def logprobs_triton(logits_TV: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Row-wise ``log_softmax(logits.float() / temperature)`` in fp32.

    Args:
        logits_TV: ``[T, V]`` fp32/bf16/fp16 logits (any strides).
        temperature: positive finite float; used as an fp32 scalar.

    Returns:
        fp32 ``[T, V]``; row ``t`` depends only on ``logits_TV[t]``.

    Raises:
        ValueError: wrong rank or dtype, ``V == 0``, temperature not positive
            and finite (or zero once rounded to fp32), a CPU tensor without
            the interpreter.
    """
    if logits_TV.dim() != 2 or logits_TV.dtype not in _IN_DTYPES:
        raise ValueError(f"logprobs_triton: logits must be [T, V] fp32/bf16/fp16, got "
                         f"{tuple(logits_TV.shape)} {logits_TV.dtype}")
    temperature = float(temperature)
    t32 = float(torch.tensor(temperature, dtype=torch.float32))
    if not (t32 > 0.0 and t32 != float("inf")):
        raise ValueError(f"logprobs_triton: temperature must be positive and finite in fp32, got {temperature}")
    T, V = logits_TV.shape
    if V == 0:
        raise ValueError("logprobs_triton: empty vocabulary (V == 0)")
    check_device("logprobs_triton", logits_TV)
    out = torch.empty((T, V), dtype=torch.float32, device=logits_TV.device)
    if T == 0:
        return out
    _logprobs_kernel[(T,)](logits_TV, out, V, t32, logits_TV.stride(0), logits_TV.stride(1),
                           out.stride(0), out.stride(1), BLOCK_V=BLOCK_V, num_warps=NUM_WARPS)
    return out


@triton.jit
def _logprobs_backward_kernel(y_ptr, g_ptr, dz_ptr, V, temperature, stride_yt, stride_gt, stride_dt,
                              BLOCK_V: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    y_row, g_row, d_row = y_ptr + t * stride_yt, g_ptr + t * stride_gt, dz_ptr + t * stride_dt
    cols = tl.arange(0, BLOCK_V)
    acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        acc += tl.load(g_row + c, mask=c < V, other=0.0)
    s = tl.sum(acc, axis=0)
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        mask = c < V
        g = tl.load(g_row + c, mask=mask, other=0.0)
        p = tl.exp(tl.load(y_row + c, mask=mask, other=0.0))
        tl.store(d_row + c, tl.math.div_rn(g - p * s, temperature), mask=mask)


def logprobs_backward_triton(logprobs_TV: torch.Tensor, grad_TV: torch.Tensor, temperature: float) -> torch.Tensor:
    """The gradient of :func:`logprobs_triton` w.r.t. its logits, one pass per row for ``sum(g)`` and one
    for ``dz = (g - exp(y) sum(g)) / temperature`` (``y`` the log-probabilities; PyTorch's
    ``_log_softmax_backward_data`` formula, divided by the temperature): three fp32 ``[T, V]`` tensors
    read or written once each, where the same formula in torch ops makes a dozen passes.

    Args:
        logprobs_TV: fp32 ``[T, V]``, the forward's output; grad_TV: fp32 ``[T, V]``, its gradient (both
            with unit stride along V); temperature: the forward's, positive and finite in fp32.

    Returns:
        fp32 ``[T, V]``: the logits' gradient (in fp32; the caller casts to the logits' dtype).

    Raises:
        ValueError: shapes, dtypes or strides other than these; a CPU tensor without the interpreter.
    """
    unit = all(t.dim() == 2 and (t.shape[1] <= 1 or t.stride(1) == 1) for t in (logprobs_TV, grad_TV))
    if (logprobs_TV.dim() != 2 or grad_TV.shape != logprobs_TV.shape or logprobs_TV.dtype != torch.float32
            or grad_TV.dtype != torch.float32 or not unit):
        raise ValueError(f"logprobs_backward_triton: logprobs {tuple(logprobs_TV.shape)} {logprobs_TV.dtype} and grad "
                         f"{tuple(grad_TV.shape)} {grad_TV.dtype} must be fp32 [T, V], unit stride along V")
    t32 = float(torch.tensor(float(temperature), dtype=torch.float32))
    if not (t32 > 0.0 and t32 != float("inf")):
        raise ValueError(f"logprobs_backward_triton: temperature must be positive and finite in fp32, got {temperature}")
    check_device("logprobs_backward_triton", logprobs_TV)
    T, V = logprobs_TV.shape
    dz = torch.empty((T, V), dtype=torch.float32, device=logprobs_TV.device)
    if T and V:
        _logprobs_backward_kernel[(T,)](logprobs_TV, grad_TV, dz, V, t32, logprobs_TV.stride(0), grad_TV.stride(0),
                                        dz.stride(0), BLOCK_V=BLOCK_V, num_warps=NUM_WARPS)
    return dz


@triton.jit
def _token_logprobs_backward_kernel(y_ptr, ids_ptr, g_ptr, V, temperature, stride_yt, BLOCK_V: tl.constexpr):
    """Row ``t`` of ``dz = (g - exp(y) sum(g)) / temperature`` for the one-hot ``g`` of a gathered token
    logprob, written over ``y``: ``_logprobs_backward_kernel``'s expression with the row's ``g`` made
    in registers (``g_t`` at column ``ids[t]``, else 0) and ``sum(g) = g_t + 0`` (what that kernel's
    sum of one nonzero and zeros gives), so the same operations on the same values."""
    t = tl.program_id(0).to(tl.int64)
    y_row = y_ptr + t * stride_yt
    gt = tl.load(g_ptr + t)
    tok = tl.load(ids_ptr + t).to(tl.int64)
    s = gt + 0.0
    cols = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        mask = c < V
        g = tl.where(c == tok, gt, 0.0)
        p = tl.exp(tl.load(y_row + c, mask=mask, other=0.0))
        tl.store(y_row + c, tl.math.div_rn(g - p * s, temperature), mask=mask)


def token_logprobs_backward_triton_(logprobs_TV: torch.Tensor, token_ids_T: torch.Tensor, grad_T: torch.Tensor,
                                    temperature: float) -> torch.Tensor:
    """In place: the logits' gradient of ``logprobs_TV[t, ids[t]]`` written over ``logprobs_TV`` and
    returned: bit for bit :func:`logprobs_backward_triton` of the scattered one-hot gradient (the
    unfused ``gather`` backward), without the two other fp32 ``[T, V]`` tensors (the scattered
    gradient and a separate output). Megatron's vocab-parallel cross entropy writes its gradient
    over its softmax in the same way.

    Args:
        logprobs_TV: fp32 ``[T, V]`` (unit stride along V), the forward's log-probabilities;
            overwritten. token_ids_T: int ``[T]`` in ``[0, V)``. grad_T: fp32 ``[T]``.
        temperature: the forward's, positive and finite in fp32.

    Raises:
        ValueError: shapes, dtypes or strides other than these; a CPU tensor without the interpreter.
    """
    if (logprobs_TV.dim() != 2 or logprobs_TV.dtype != torch.float32
            or (logprobs_TV.shape[1] > 1 and logprobs_TV.stride(1) != 1)
            or tuple(token_ids_T.shape) != (logprobs_TV.shape[0],) or tuple(grad_T.shape) != (logprobs_TV.shape[0],)):
        raise ValueError(f"token_logprobs_backward_triton_: logprobs {tuple(logprobs_TV.shape)} {logprobs_TV.dtype}, ids "
                         f"{tuple(token_ids_T.shape)} and grad {tuple(grad_T.shape)} must be fp32 [T, V] (unit stride "
                         "along V), [T] and [T]")
    t32 = float(torch.tensor(float(temperature), dtype=torch.float32))
    if not (t32 > 0.0 and t32 != float("inf")):
        raise ValueError(f"token_logprobs_backward_triton_: temperature must be positive and finite in fp32, got "
                         f"{temperature}")
    check_device("token_logprobs_backward_triton_", logprobs_TV, token_ids_T, grad_T)
    T, V = logprobs_TV.shape
    if T and V:
        _token_logprobs_backward_kernel[(T,)](logprobs_TV, token_ids_T.contiguous(), grad_T.float().contiguous(), V, t32,
                                              logprobs_TV.stride(0), BLOCK_V=BLOCK_V, num_warps=NUM_WARPS)
    return logprobs_TV
