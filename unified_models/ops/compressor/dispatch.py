"""``compress_pool``'s public op: the Triton kernel (:mod:`.triton`) on GPU, the CPU path
(:mod:`.cpu`) otherwise (``ops/_dispatch.py``)."""

from __future__ import annotations

import torch

from .._dispatch import use_triton
from .common import check_pool_args
from .cpu import compress_pool_torch


def compress_pool(kv_ENC: torch.Tensor, score_ENC: torch.Tensor) -> torch.Tensor:
    """Pool each entry's candidates: ``out[e, c] = sum_n softmax_n(score[e, :, c])[n] * kv[e, n, c]``.

    The per-channel softmax over the N candidates is max-subtracted; every sum over N runs in
    the fixed order ``n = 0, 1, ..., N-1``. A candidate with score ``-inf`` has weight 0 and its
    kv is not used (it may hold anything, NaN included); a channel whose N scores are all
    ``-inf`` gives 0. Scores must otherwise be finite: a NaN or ``+inf`` score gives NaN.

    Source: transformers 5.19 ``DeepseekV4CSACompressor.forward`` /
    ``DeepseekV4HCACompressor.forward`` (``(kv * gate.softmax(dim=2, dtype=torch.float32))
    .sum(dim=2)``, here with the product and the sum in fp32) and vLLM's DeepSeek-V4
    compressor kernel (``fused_compress_quant_cache.py``: ``tl.softmax`` over the candidates,
    then ``tl.sum(kv * score)``).

    Args:
        kv_ENC: ``[E, N, C]`` fp32 candidate rows: E entries, N candidates (CSA: 2m, block
            i-1's channels ``[:d]`` first, then block i's ``[d:]``; HCA: m), C channels.
        score_ENC: ``[E, N, C]`` fp32 scores (``wgate x + ape[p % m]``), same device.

    Returns:
        ``[E, C]`` fp32 on the inputs' device. Row ``e`` depends only on
        ``kv_ENC[e]`` and ``score_ENC[e]`` (batch-invariant, deterministic): on CPU by the
        fixed-chain path of :mod:`.cpu`, on GPU by the Triton kernel (its own bits: its exp
        is the GPU's).

    Raises:
        ValueError: not 3-D, not fp32, shapes differ, ``N < 1``, or different devices (the
            message names the argument).
    """
    check_pool_args("compress_pool", kv_ENC, score_ENC)
    if use_triton(kv_ENC):
        from .triton import compress_pool_triton

        return compress_pool_triton(kv_ENC, score_ENC)
    return compress_pool_torch(kv_ENC, score_ENC)
