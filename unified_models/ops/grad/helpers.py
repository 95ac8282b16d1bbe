"""Helpers shared by the families' backward modules (``ops/<family>/backward.py``).

:func:`acc` and :func:`_cast` pick the backward's accumulation dtype and cast a
gradient back to its input's dtype; :func:`needs_grad` decides whether an entry
point builds a graph at all; :func:`index_add_rows` is the backward's scatter-add
(the same bits on every run, also on CUDA); :func:`grad_matmul` its GEMM, and
:class:`RecomputeBmm` that GEMM inside a recomputation under autograd.
"""

from __future__ import annotations

import os

import torch


def acc(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the backward's accumulation dtype: fp64 stays fp64, else fp32."""
    return t.double() if t.dtype == torch.float64 else t.float()


def _cast(g: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return None if g is None or like is None else g.to(like.dtype)


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """True when grad mode is on and one of ``tensors`` requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def sorted_accumulate(t: torch.Tensor) -> bool:
    """Whether :func:`index_add_rows` sums through ``index_put_(accumulate=True)`` for a tensor on
    ``t``'s device (CUDA, and any other non-CPU device) rather than ``index_add_`` (the CPU).
    ``tests/ops/test_backward_determinism.py`` forces it on the CPU to audit the CUDA form."""
    return t.device.type != "cpu"


def index_add_rows(dst_X: torch.Tensor, index_Y: torch.Tensor, src_Y: torch.Tensor) -> torch.Tensor:
    """``dst[index[i]] += src[i]`` for every ``i`` along dim 0, in place, with the same bits on every run.

    ``index_add_``'s CUDA kernel adds with atomics (``fastAtomicAdd``, PyTorch
    ``aten/src/ATen/native/cuda/Indexing.cu``), so a destination row that several ``i`` hit (an
    embedding row of a repeated token, a compressed entry several queries read) gets its sum in
    a different order from run to run, and ``rl --resume`` could not continue bitwise. On CUDA
    this sums through ``index_put_(indices, src, accumulate=True)`` instead, PyTorch's sort-based
    kernel (what ``torch.use_deterministic_algorithms(True)`` makes ``index_add_`` do, without
    switching that mode on for everything); on the CPU ``index_add_`` (serial over ``index``).

    Args:
        dst_X: ``[X, ...]`` floating tensor, updated in place.
        index_Y: ``[Y]`` int32 / int64 destination rows, each in ``[0, X)`` (repeats allowed).
        src_Y: ``[Y, ...]`` rows to add (``dst``'s dtype and trailing shape).

    Returns:
        ``dst_X`` itself.

    Raises:
        ValueError: ``index`` is not 1-D, or ``src`` has another row count than ``index`` or another
            row shape than ``dst``.
        IndexError / RuntimeError: from torch on the CPU, for an index out of range. The CUDA form does not
            check the range (that would wait for the device): a negative index wraps, as in ``t[idx]``.
            Callers build the indices in range.
    """
    if index_Y.dim() != 1 or src_Y.shape[0] != index_Y.shape[0] or src_Y.shape[1:] != dst_X.shape[1:]:
        raise ValueError(f"index_add_rows: index {tuple(index_Y.shape)} (1-D), src {tuple(src_Y.shape)} and dst "
                         f"{tuple(dst_X.shape)} must give one src row per index, rows of dst's shape")
    if sorted_accumulate(dst_X):
        return dst_X.index_put_((index_Y.long(),), src_Y, accumulate=True)
    return dst_X.index_add_(0, index_Y, src_Y)


_HALF = (torch.bfloat16, torch.float16)


def _mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of two bf16 (or two fp16) 2-D (or batched 3-D) tensors with fp32 accumulation and an fp32
    result, on tensor cores (``torch.mm`` / ``torch.bmm`` with ``out_dtype=torch.float32``, cuBLAS). Every
    product of two bf16 values is exact in fp32, so this is an fp32 GEMM of the upcasts up to summation
    order."""
    op = torch.mm if a.dim() == 2 else torch.bmm
    try:
        try:
            return op(a, b, out_dtype=torch.float32)
        except RuntimeError:  # a layout cuBLAS's mixed-dtype path does not take: retry with dense operands
            return op(a.contiguous(), b.contiguous(), out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError) as e:  # a torch without mm's out_dtype on CUDA
        global _MM_FALLBACK_WARNED
        if not _MM_FALLBACK_WARNED:
            import warnings

            warnings.warn(f"torch.mm(out_dtype=float32) is unavailable ({type(e).__name__}: {e}); the backward's "
                          "GEMMs run in fp32 on CUDA cores (slow)", RuntimeWarning, stacklevel=3)
            _MM_FALLBACK_WARNED = True
        return a.float() @ b.float()


_MM_FALLBACK_WARNED = False


BACKWARD_GEMM_ENV = "UM_BACKWARD_GEMM"
"""Environment variable choosing how the backward's GEMMs on CUDA take an fp32 operand in a half-precision
model (:func:`backward_gemm_mode`)."""

BACKWARD_GEMM_MODES = ("split", "bf16")


def backward_gemm_mode() -> str:
    """How :func:`grad_matmul` feeds an fp32 operand to bf16 tensor cores, from ``UM_BACKWARD_GEMM``
    (read on every call, so a test or a run can set it):

    * ``split`` (default, also when unset or empty): ``hi + lo``, two bf16 terms (16 significant bits;
      error below ``2^-15`` of ``|a| @ |b|``);
    * ``bf16``: rounded to bf16, one term (error below ``2^-8`` of ``|a| @ |b|``): what Megatron-core's
      backward does with every operand; fewer GEMMs (the lm head's input and weight gradients: 2, not 4).

    The sampler's and the trainer's logprobs do not depend on it (forward only); gradients do, within
    those bounds. ``scripts/gpu-run.sh trainer-cost`` records the mode it ran under.

    Raises:
        ValueError: any other value, naming the variable and the values it takes.
    """
    mode = os.environ.get(BACKWARD_GEMM_ENV, "") or "split"
    if mode not in BACKWARD_GEMM_MODES:
        raise ValueError(f"{BACKWARD_GEMM_ENV}={mode!r}: expected one of {', '.join(BACKWARD_GEMM_MODES)} "
                         "(split: fp32 operands as two bf16 terms, the default; bf16: rounded, one term)")
    return mode


def _bf16_terms(t: torch.Tensor, split: bool = True) -> list[torch.Tensor]:
    """``t`` as a sum of bf16 tensors: itself when half precision; else ``hi + lo`` with
    ``hi = bf16(t)``, ``lo = bf16(t - hi)`` (16 significant bits of each fp32 value; the rest, below
    ``2^-16`` of it, is dropped), or ``hi`` alone without ``split``."""
    if t.dtype in _HALF:
        return [t]
    hi = t.to(torch.bfloat16)
    if not split:
        return [hi]
    lo = torch.empty_like(hi)
    torch.sub(t, hi, out=lo)  # one kernel: t - hi in fp32 (exact), rounded once to bf16
    return [hi, lo]


def grad_matmul(a_MK: torch.Tensor, b_KN: torch.Tensor, *, split_fp32: bool = False, mm=None) -> torch.Tensor:
    """``a @ b`` -> fp32 ``[M, N]`` (batched: ``[B, M, K] @ [B, K, N]`` -> ``[B, M, N]``), for a backward's
    GEMMs (``dX = dY W``, ``dW = dY^T X``, ...).

    With an fp64 operand: the fp64 product. On the CPU: ``acc(a) @ acc(b)`` (fp32), as every backward did before.

    On CUDA with fp32 / bf16 / fp16 operands, on tensor cores (an fp32 GEMM runs on the H200's CUDA
    cores, ~1/10 of the bf16 rate: it made our optimizer step's backward 9x Megatron's,
    ``benchmarks/results/h200_session24/trainer_cost_nemotron_h_dense_bench.json``):

    * a bf16 (or fp16) operand is used as it is;
    * an fp32 operand beside a half-precision one (or, with ``split_fp32``, beside another fp32 one)
      is split into ``hi + lo``, two bf16 tensors (16 significant bits);
    * two fp32 operands without ``split_fp32`` give the fp32 GEMM (an fp32 model's gradients keep
      fp32 accuracy; a bf16 model's backward passes ``split_fp32`` for its fp32 intermediates);
    * the result is the fp32 sum of the bf16 GEMMs of the term pairs, dropping ``lo x lo`` (1 GEMM for
      two half operands, 2 for one fp32 operand, 3 for two), each accumulated in fp32 with exact
      products (:func:`_mm_fp32_out`); where the fp32 result is large beside the operands (an
      activation gradient: ``M`` tokens), the pairs run as one GEMM over the terms concatenated along
      ``K`` (no per-pair fp32 result to write, read and add; :func:`_one_gemm_is_cheaper`).

    The error against the fp32 GEMM is below ``2^-15`` of ``|a| @ |b|`` per element (Megatron-core's
    backward rounds both operands to bf16: ``2^-8``; ``UM_BACKWARD_GEMM=bf16`` does the same here, one
    term per operand: :func:`backward_gemm_mode`). Gradients are not bitwise across layouts
    anyway (DESIGN.md rule 11); the forward's logprob bits do not depend on this function.

    Args:
        a_MK, b_KN: 2-D tensors on one device (any strides), or two 3-D tensors with the same batch
            size (one GEMM per batch entry, e.g. one per expert); ``split_fp32``: split two fp32
            operands too (above); ``mm``: the half-precision GEMM with
            fp32 output (default :func:`_mm_fp32_out`; tests pass an emulation to run the CUDA
            path's splitting on the CPU).

    Raises:
        ValueError: operands that are not both 2-D (or both 3-D with one batch size) or whose inner
            sizes differ; a bad ``UM_BACKWARD_GEMM`` (on the CUDA path with an fp32 operand).
    """
    if a_MK.dim() != b_KN.dim() or a_MK.dim() not in (2, 3) or a_MK.shape[-1] != b_KN.shape[-2] or \
            a_MK.shape[:-2] != b_KN.shape[:-2]:
        raise ValueError(f"grad_matmul: {list(a_MK.shape)} @ {list(b_KN.shape)} is not a 2-D (or batched 3-D) "
                         "matrix product")
    if torch.float64 in (a_MK.dtype, b_KN.dtype):
        return a_MK.double() @ b_KN.double()
    if mm is None and not a_MK.is_cuda:
        return acc(a_MK) @ acc(b_KN)
    if a_MK.dtype == b_KN.dtype == torch.float32 and not split_fp32:
        return a_MK @ b_KN
    mm = mm or _mm_fp32_out
    if a_MK.dtype == b_KN.dtype and a_MK.dtype in _HALF:
        return mm(a_MK, b_KN)
    # bf16 stays one term; fp32 (and fp16 beside another dtype, via its exact fp32) becomes hi + lo
    split = backward_gemm_mode() == "split"
    ta, tb = (_bf16_terms(t if t.dtype in (torch.bfloat16, torch.float32) else t.float(), split)
              for t in (a_MK, b_KN))
    pairs = [(x, y) for i, x in enumerate(ta) for j, y in enumerate(tb) if i + j < 2]  # lo x lo dropped
    if _one_gemm_is_cheaper(a_MK, b_KN, len(pairs), len(ta), len(tb)):
        # sum_p x_p y_p as one GEMM over the terms side by side along K: [x_1 .. x_n] @ [y_1; ..; y_n]
        return mm(torch.cat([x for x, _ in pairs], dim=-1), torch.cat([y for _, y in pairs], dim=-2))
    parts = [mm(x, y) for x, y in pairs]
    out = parts.pop()  # the smallest terms first: (hi lo + lo hi) + hi hi
    while parts:
        out = out.add_(parts.pop())
    return out


def _one_gemm_is_cheaper(a_MK: torch.Tensor, b_KN: torch.Tensor, pairs: int, terms_a: int, terms_b: int) -> bool:
    """Whether the term pairs run as one GEMM over concatenated operands (bytes written for the copies
    of terms used twice) rather than one GEMM each (an fp32 ``[M, N]`` result per extra pair, written,
    read and added: 12 bytes per element); the former for an activation gradient (``M`` tokens, small
    ``K``), the latter for a weight gradient (``K`` tokens, small ``[M, N]``)."""
    if pairs == 1:
        return False
    M, K, N = a_MK.shape[-2], a_MK.shape[-1], b_KN.shape[-1]
    concat = 2 * K * (pairs * M + pairs * N)  # both operands written side by side, bf16
    separate = 12 * (pairs - 1) * M * N
    return concat < separate


class RecomputeBmm(torch.autograd.Function):
    """``a @ b`` (``[G, M, K] @ [G, K, N]`` fp32 tensors) inside a backward's recomputation under autograd
    (DeepSeek-V4's windowed attention), and its two gradients, through :func:`grad_matmul`: with
    ``half`` (bf16: a bf16 model on CUDA) on tensor cores, an operand the caller marks exact (its values are
    bf16 values: a bf16 input, K/V read back from a bf16 or FP8 cache, an FP8 activation, weights dequantized
    to bf16) as one bf16 term, any other fp32 operand (probabilities, the SwiGLU output, the upstream
    gradients) as ``hi + lo``; fp32 results (error below ``2^-15`` of ``|a| @ |b|``). On the CPU and for
    fp32 / fp64 models (``half`` None): the plain product in the operands' dtype.

    Apply as ``RecomputeBmm.apply(a, b, a_exact, b_exact, half)``."""

    @staticmethod
    def forward(ctx, a, b, a_exact: bool, b_exact: bool, half):
        ctx.save_for_backward(a, b)
        ctx.exact, ctx.half = (a_exact, b_exact), half
        return grad_matmul(_as_half(a, a_exact, half), _as_half(b, b_exact, half), split_fp32=half is not None)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        (a_exact, b_exact), half = ctx.exact, ctx.half
        split = half is not None
        da = grad_matmul(g, _as_half(b, b_exact, half).transpose(1, 2), split_fp32=split).to(a.dtype) \
            if ctx.needs_input_grad[0] else None
        db = grad_matmul(_as_half(a, a_exact, half).transpose(1, 2), g, split_fp32=split).to(b.dtype) \
            if ctx.needs_input_grad[1] else None
        return da, db, None, None, None


def _as_half(t: torch.Tensor, exact: bool, half: torch.dtype | None) -> torch.Tensor:
    return t.to(half) if exact and half is not None else t
