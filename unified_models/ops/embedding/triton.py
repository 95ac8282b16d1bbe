"""Embedding lookup in Triton: ``out[t] = weight[input_ids[t]]``, an exact copy."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton._common import FLOAT_DTYPES, INTERPRET, check_device, next_pow2

_MAX_BLOCK_D = 4096 if INTERPRET else 1024


@triton.jit
def _embedding_kernel(ids_ptr, w_ptr, out_ptr, V, D, stride_wv, stride_wd, stride_ot, stride_od,
                      BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = d < D
    tok = tl.load(ids_ptr + t).to(tl.int64)
    valid = (tok >= 0) & (tok < V)
    # Out-of-range ids (only possible on CUDA, where they are not checked on
    # the host) give a zero row instead of reading out of bounds.
    tok = tl.where(valid, tok, 0)
    d_lim = tl.where(valid, D, 0)  # (a scalar bool in a mask trips the interpreter)
    row = tl.load(w_ptr + tok * stride_wv + d * stride_wd, mask=d < d_lim, other=0)
    tl.store(out_ptr + t * stride_ot + d * stride_od, row, mask=mask)


def embedding_triton(input_ids_T: torch.Tensor, weight_VD: torch.Tensor) -> torch.Tensor:
    """Gather rows of an embedding table (exact copy, batch-invariant trivially).

    Args:
        input_ids_T: int32/int64 ``[T]`` token ids in ``[0, V)``.
        weight_VD: ``[V, D]`` table (bf16/fp16/fp32; any strides).

    Returns:
        ``[T, D]`` in ``weight_VD.dtype``.

    Raises:
        ValueError: wrong ranks or dtypes, tensors on different devices, or
            (CPU/interpreter only, where the check costs no device sync) an id
            outside ``[0, V)``. On CUDA an out-of-range id yields a zero row.
    """
    if input_ids_T.dim() != 1 or input_ids_T.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"embedding_triton: input_ids must be 1-D int32/int64, got "
                         f"{tuple(input_ids_T.shape)} {input_ids_T.dtype}")
    if weight_VD.dim() != 2 or weight_VD.dtype not in FLOAT_DTYPES:
        raise ValueError(f"embedding_triton: weight must be [V, D] bf16/fp16/fp32, got "
                         f"{tuple(weight_VD.shape)} {weight_VD.dtype}")
    check_device("embedding_triton", input_ids_T, weight_VD)
    V, D = weight_VD.shape
    T = input_ids_T.shape[0]
    if not input_ids_T.is_cuda and T > 0:
        lo, hi = int(input_ids_T.min()), int(input_ids_T.max())
        if lo < 0 or hi >= V:
            raise ValueError(f"embedding_triton: token ids must be in [0, {V}), got range [{lo}, {hi}]")
    out = torch.empty((T, D), dtype=weight_VD.dtype, device=weight_VD.device)
    if T == 0 or D == 0:
        return out
    block_d = min(next_pow2(D), _MAX_BLOCK_D)
    grid = (T, triton.cdiv(D, block_d))
    _embedding_kernel[grid](input_ids_T, weight_VD, out, V, D, weight_VD.stride(0), weight_VD.stride(1),
                            out.stride(0), out.stride(1), BLOCK_D=block_d, num_warps=4)
    return out
