"""The backward's tensor-core GEMMs emulated on the CPU, for tests of the CUDA path's precision and work.

:func:`emulate_tensor_cores` routes a module's ``grad_matmul`` through its CUDA path (fp32 operands split into
bf16 terms, ``UM_BACKWARD_GEMM`` honoured) with the half-precision GEMM emulated: bf16 operands asserted,
exact products, fp32 sums (what ``torch.mm(out_dtype=float32)`` on tensor cores computes up to summation
order). :func:`gemm_work` counts the multiply-adds of the recorded GEMMs.
"""

from __future__ import annotations

import math

import torch


def emulate_tensor_cores(monkeypatch, module) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Patch ``module.grad_matmul`` (the function that module calls) for the test's duration; returns the
    list each emulated GEMM's ``(a.shape, b.shape)`` is appended to."""
    calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def emulated(a, b):
        assert a.dtype == b.dtype == torch.bfloat16, (a.dtype, b.dtype)
        calls.append((tuple(a.shape), tuple(b.shape)))
        return a.float() @ b.float()

    real = module.grad_matmul
    monkeypatch.setattr(module, "grad_matmul",
                        lambda a, b, split_fp32=False: real(a, b, split_fp32=split_fp32, mm=emulated))
    return calls


def gemm_work(calls: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> int:
    """Multiply-adds of the GEMMs in ``calls`` (``[..., M, K] @ [..., K, N]``: ``prod(a.shape) * N``)."""
    return sum(math.prod(a) * b[-1] for a, b in calls)
