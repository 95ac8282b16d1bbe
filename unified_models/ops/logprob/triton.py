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
