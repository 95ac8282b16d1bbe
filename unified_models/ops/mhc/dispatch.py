"""mHC's public ops: argument checks, then the CPU path (:mod:`.cpu`); on CUDA (or with
``UM_OPS_BACKEND=triton``) the Triton kernels of :mod:`.triton` (no silent fallback)."""

from __future__ import annotations

import torch

from .._dispatch import use_triton
from .cpu import hc_head_torch, hc_post_torch, hc_pre_torch


def _check_streams(op: str, streams_TND: torch.Tensor) -> tuple[int, int, int]:
    if streams_TND.dim() != 3 or not streams_TND.is_floating_point():
        raise ValueError(f"{op}: streams must be a float [T, n, D] tensor, got {tuple(streams_TND.shape)} "
                         f"{streams_TND.dtype}")
    return tuple(streams_TND.shape)


def _check_shape(op: str, what: str, t: torch.Tensor, want: tuple[int, ...]) -> None:
    if tuple(t.shape) != want:
        raise ValueError(f"{op}: {what} has shape {tuple(t.shape)}, expected {want} for the streams given")


def hc_pre(streams_TND: torch.Tensor, fn_MK: torch.Tensor, base_M: torch.Tensor, scale_3: torch.Tensor, *,
           norm_eps: float, hc_eps: float, sinkhorn_iters: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HC pre of one sublayer: mixing weights from the streams, and the sublayer's input.

    With ``flat = rms(h.flatten().float())`` (unweighted, ``norm_eps``), ``mix = flat fn^T`` (fp32):
    ``pre = sigmoid(mix[:n] scale[0] + base[:n]) + hc_eps``,
    ``post = 2 sigmoid(mix[n:2n] scale[1] + base[n:2n])``,
    ``comb = sinkhorn(softmax_rows(mix[2n:] scale[2] + base[2n:]) + hc_eps)`` (columns, then
    ``sinkhorn_iters - 1`` times rows and columns, each ``/ (sum + hc_eps)``), and
    ``x = round(sum_j pre_j h_j)`` (fp32 products and sums, one rounding to h's dtype).
    Source: transformers ``DeepseekV4HyperConnection.forward`` (same rounding points); mHC
    paper arXiv 2512.24880 eqs. for H_pre, H_post, H_res.

    Args:
        streams_TND: ``[T, n, D]`` streams (bf16 / fp32).
        fn_MK: ``[M, n D]`` projection, ``M = (2 + n) n`` (any float dtype; used in fp32).
        base_M: ``[M]`` biases; scale_3: ``[3]`` pre / post / comb scales.
        norm_eps: epsilon of the unweighted RMS norm (config ``rms_norm_eps``).
        hc_eps: config ``hc_eps``; sinkhorn_iters: config ``hc_sinkhorn_iters`` (>= 1).

    Returns:
        ``(x [T, D] in h's dtype, post [T, n] fp32, comb [T, n, n] fp32)``; row ``t``
        depends only on ``streams_TND[t]``.

    Raises:
        ValueError: a shape does not match the streams, or ``sinkhorn_iters < 1``; on the Triton
            path (CUDA, or ``UM_OPS_BACKEND=triton``) streams not bf16/fp32 or tensors on different devices.
    """
    t, n, d = _check_streams("hc_pre", streams_TND)
    m = (2 + n) * n
    _check_shape("hc_pre", "fn", fn_MK, (m, n * d))
    _check_shape("hc_pre", "base", base_M, (m,))
    _check_shape("hc_pre", "scale", scale_3, (3,))
    if sinkhorn_iters < 1:
        raise ValueError(f"hc_pre: sinkhorn_iters must be >= 1, got {sinkhorn_iters}")
    if use_triton(streams_TND):
        from .triton import hc_pre_triton

        return hc_pre_triton(streams_TND, fn_MK, base_M, scale_3, norm_eps, hc_eps, sinkhorn_iters)
    return hc_pre_torch(streams_TND, fn_MK, base_M, scale_3, norm_eps, hc_eps, sinkhorn_iters)


def hc_post(streams_TND: torch.Tensor, y_TD: torch.Tensor, post_TN: torch.Tensor,
            comb_TNN: torch.Tensor) -> torch.Tensor:
    """HC post: the streams after a sublayer, ``h'_k = post_k y + sum_j comb[j, k] h_j``.

    Rounded as transformers' ``DeepseekV4DecoderLayer.forward``: ``post`` and ``comb`` to
    h's dtype first, ``post ⊗ y`` and ``comb^T h`` (fp32 accumulation in stream order) each
    rounded to h's dtype, then their sum in h's dtype.

    Args:
        streams_TND: ``[T, n, D]`` streams before the sublayer; y_TD: ``[T, D]`` its output
            (same dtype); post_TN, comb_TNN: ``[T, n]`` and ``[T, n, n]`` from :func:`hc_pre`.

    Returns:
        ``[T, n, D]`` in h's dtype; rows independent.

    Raises:
        ValueError: shapes or dtypes do not match; on the Triton path as :func:`hc_pre`.
    """
    t, n, d = _check_streams("hc_post", streams_TND)
    _check_shape("hc_post", "y", y_TD, (t, d))
    _check_shape("hc_post", "post", post_TN, (t, n))
    _check_shape("hc_post", "comb", comb_TNN, (t, n, n))
    if y_TD.dtype != streams_TND.dtype:
        raise ValueError(f"hc_post: y is {y_TD.dtype}, the streams {streams_TND.dtype}")
    if use_triton(streams_TND):
        from .triton import hc_post_triton

        return hc_post_triton(streams_TND, y_TD, post_TN, comb_TNN)
    return hc_post_torch(streams_TND, y_TD, post_TN, comb_TNN)


def hc_head(streams_TND: torch.Tensor, fn_NK: torch.Tensor, base_N: torch.Tensor, scale_1: torch.Tensor, *,
            norm_eps: float, hc_eps: float) -> torch.Tensor:
    """hc_head: collapse the streams into one before the final norm.

    ``pre = sigmoid(rms(h.flatten().float()) fn^T scale + base) + hc_eps`` (fp32), then
    ``round(sum_j pre_j h_j)``. Source: transformers ``DeepseekV4HyperHead.forward``.

    Args:
        streams_TND: ``[T, n, D]``; fn_NK: ``[n, n D]``; base_N: ``[n]``; scale_1: ``[1]``.
        norm_eps, hc_eps: as :func:`hc_pre`.

    Returns:
        ``[T, D]`` in h's dtype; rows independent.

    Raises:
        ValueError: a shape does not match the streams; on the Triton path as :func:`hc_pre`.
    """
    t, n, d = _check_streams("hc_head", streams_TND)
    _check_shape("hc_head", "hc_fn", fn_NK, (n, n * d))
    _check_shape("hc_head", "hc_base", base_N, (n,))
    _check_shape("hc_head", "hc_scale", scale_1, (1,))
    if use_triton(streams_TND):
        from .triton import hc_head_triton

        return hc_head_triton(streams_TND, fn_NK, base_N, scale_1, norm_eps, hc_eps)
    return hc_head_torch(streams_TND, fn_NK, base_N, scale_1, norm_eps, hc_eps)
