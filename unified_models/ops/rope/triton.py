"""RoPE (neox layout) in Triton: one program per (token, head), fp32 math, one rounding."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton._common import FLOAT_DTYPES, check_device, next_pow2, round_to


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, out_ptr, H, E, HALF,
                 stride_xt, stride_xh, stride_ot, stride_oh, stride_cp,
                 BLOCK_HALF: tl.constexpr, BLOCK_E: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    p = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    m = i < HALF
    c = tl.load(cos_ptr + p * stride_cp + i, mask=m, other=0.0)
    s = tl.load(sin_ptr + p * stride_cp + i, mask=m, other=0.0)
    xb = x_ptr + t * stride_xt + h * stride_xh
    ob = out_ptr + t * stride_ot + h * stride_oh
    x1 = tl.load(xb + i, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xb + HALF + i, mask=m, other=0.0).to(tl.float32)
    tl.store(ob + i, round_to(x1 * c - x2 * s, out_ptr.dtype.element_ty), mask=m)
    tl.store(ob + HALF + i, round_to(x2 * c + x1 * s, out_ptr.dtype.element_ty), mask=m)
    j = 2 * HALF + tl.arange(0, BLOCK_E)
    mj = j < E
    tl.store(ob + j, tl.load(xb + j, mask=mj, other=0.0), mask=mj)


def apply_rope_triton(x_THE: torch.Tensor, positions_T: torch.Tensor, cos_PR: torch.Tensor,
                      sin_PR: torch.Tensor) -> torch.Tensor:
    """Neox RoPE on ``[T, H, E]`` with fp32 tables ``[P, R/2]``; see ``ops.rope.apply_rope``.

    Raises:
        ValueError: unsupported dtype or devices differ.
    """
    if x_THE.dtype not in FLOAT_DTYPES:
        raise ValueError(f"apply_rope_triton: x must be bf16/fp16/fp32, got {x_THE.dtype}")
    check_device("apply_rope_triton", x_THE, positions_T, cos_PR, sin_PR)
    t, h, e = x_THE.shape
    half = cos_PR.shape[1]
    x = x_THE if x_THE.stride(2) == 1 else x_THE.contiguous()
    cos, sin = cos_PR.contiguous().float(), sin_PR.contiguous().float()
    out = torch.empty((t, h, e), dtype=x.dtype, device=x.device)
    if t and h:
        _rope_kernel[(t, h)](x, positions_T.contiguous(), cos, sin, out, h, e, half,
                             x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0),
                             BLOCK_HALF=next_pow2(max(half, 1)), BLOCK_E=next_pow2(max(e, 1)), num_warps=1)
    return out
