"""MLP activations in Triton: fp32 math, one rounding (elementwise, so
batch-invariant by construction; the block size is a fixed constant)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton._common import FLOAT_DTYPES, INTERPRET, check_device, round_to

BLOCK = 65536 if INTERPRET else 1024


@triton.jit
def _relu2_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.maximum(x, 0.0)
    tl.store(out_ptr + offs, round_to(r * r, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(out_ptr + offs, round_to(y, out_ptr.dtype.element_ty), mask=mask)


def relu2_triton(x: torch.Tensor) -> torch.Tensor:
    """``relu(x)^2`` elementwise in fp32, rounded once.

    Args:
        x: any shape, bf16/fp16/fp32 (non-contiguous inputs are copied).

    Returns:
        Same shape and dtype as ``x``.

    Raises:
        ValueError: unsupported dtype, or a CPU tensor without the interpreter.
    """
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"relu2_triton: x must be bf16/fp16/fp32, got {x.dtype}")
    check_device("relu2_triton", x)
    xc = x.contiguous()
    out = torch.empty_like(xc)
    n = xc.numel()
    if n:
        _relu2_kernel[(triton.cdiv(n, BLOCK),)](xc, out, n, BLOCK=BLOCK, num_warps=4)
    return out


def swiglu_triton(gate_TF: torch.Tensor, up_TF: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in fp32, rounded once to ``gate_TF.dtype``.

    Args:
        gate_TF: ``[T, F]`` (any shape) bf16/fp16/fp32.
        up_TF: same shape as ``gate_TF``, bf16/fp16/fp32.

    Returns:
        ``[T, F]`` in ``gate_TF.dtype``.

    Raises:
        ValueError: shapes differ, unsupported dtypes, devices differ.
    """
    if gate_TF.shape != up_TF.shape:
        raise ValueError(f"swiglu_triton: gate {tuple(gate_TF.shape)} and up {tuple(up_TF.shape)} differ")
    if gate_TF.dtype not in FLOAT_DTYPES or up_TF.dtype not in FLOAT_DTYPES:
        raise ValueError(f"swiglu_triton: gate/up must be bf16/fp16/fp32, got {gate_TF.dtype}/{up_TF.dtype}")
    check_device("swiglu_triton", gate_TF, up_TF)
    g = gate_TF.contiguous()
    u = up_TF.contiguous()
    out = torch.empty_like(g)
    n = g.numel()
    if n:
        _swiglu_kernel[(triton.cdiv(n, BLOCK),)](g, u, out, n, BLOCK=BLOCK, num_warps=4)
    return out
