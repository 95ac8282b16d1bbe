"""The attention ops (KV-cache write and read, paged attention): argument and scale checks,
then the Triton kernel (:mod:`.triton`) on GPU or the CPU path (:mod:`.cpu`)."""

from __future__ import annotations

import torch

from .._dispatch import use_triton
from .common import CompressedKV, check_compressed, check_kv_scales, check_sink, check_sliding_window, kv_cache_is_fp8
from .cpu import paged_attention_torch, read_kv_cache_torch, write_kv_cache_torch


def _check(q_THE, k_cache, v_cache, block_table_BN, seq_idx_T, positions_T):
    if q_THE.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"attention: q {tuple(q_THE.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)} must be [T,H,E] and two equal [N,S,G,E]")
    h, g = q_THE.shape[1], k_cache.shape[2]
    if h % g or q_THE.shape[2] != k_cache.shape[3]:
        raise ValueError(f"attention: {h} q heads / {g} kv heads or head dims {q_THE.shape[2]} vs {k_cache.shape[3]} mismatch")
    if block_table_BN.dim() != 2 or seq_idx_T.shape != positions_T.shape or seq_idx_T.shape[0] != q_THE.shape[0]:
        raise ValueError("attention: block_table must be [B, max_blocks]; seq_idx and positions must be [T]")


def check_shared_kv(what: str, k_TGE, v_TGE, k_cache, v_cache, k_scale, v_scale) -> None:
    """A shared K = V cache (``v_cache is k_cache``) takes one tensor: ``v_TGE is k_TGE``
    and (FP8) ``v_scale is k_scale``.

    Raises:
        ValueError: a shared cache given a different V tensor or V scale.
    """
    if v_cache is not k_cache:
        return
    if v_TGE is not k_TGE:
        raise ValueError(f"{what}: v_cache is k_cache (a shared K = V cache) but v is not the same tensor as k; "
                         "pass k as v")
    if v_scale is not k_scale:
        raise ValueError(f"{what}: a shared K = V cache has one scale; pass k_scale as v_scale")


def write_kv_cache(k_TGE: torch.Tensor, v_TGE: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping_T: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """Write this step's K/V rows into the paged cache (in place).

    Args:
        k_TGE, v_TGE: ``[T, G, E]`` new keys/values.
        k_cache, v_cache: ``[N, S, G, E]`` cache views (any strides); model
            dtype (an exact cast) or float8_e4m3fn (the FP8 write rule of the
            package docstring). ``v_cache is k_cache``: one shared K = V cache
            (MLA-style), written once from ``k_TGE`` (then ``v_TGE is k_TGE``).
        slot_mapping_T: int ``[T]``, ``block * S + offset``; ``< 0`` = padding, skipped.
        k_scale, v_scale: fp32 ``[]`` scales, required for (and only for) an FP8 cache.

    Raises:
        ValueError: shape mismatch; missing, superfluous or bad scales
            (:func:`check_kv_scales`); a shared cache given a different V (:func:`check_shared_kv`).
    """
    if k_TGE.shape != v_TGE.shape or k_TGE.shape[1:] != k_cache.shape[2:] or slot_mapping_T.shape[0] != k_TGE.shape[0]:
        raise ValueError(f"write_kv_cache: k {tuple(k_TGE.shape)} does not fit cache {tuple(k_cache.shape)}")
    check_shared_kv("write_kv_cache", k_TGE, v_TGE, k_cache, v_cache, k_scale, v_scale)
    scales = check_kv_scales("write_kv_cache", k_cache, v_cache, k_scale, v_scale)
    ks, vs = scales if scales is not None else (None, None)
    if use_triton(k_cache):
        from .triton import write_kv_cache_triton

        return write_kv_cache_triton(k_TGE, v_TGE, k_cache, v_cache, slot_mapping_T, ks, vs)
    return write_kv_cache_torch(k_TGE, v_TGE, k_cache, v_cache, slot_mapping_T, ks, vs)


def paged_attention(q_THE: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table_BN: torch.Tensor, seq_idx_T: torch.Tensor, positions_T: torch.Tensor,
                    scale: float, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, sliding_window: int | None = None,
                    sink: torch.Tensor | None = None, compressed: CompressedKV | None = None) -> torch.Tensor:
    """Causal attention of each token over its own sequence's cached K/V.

    A token at position p reads positions ``0..p``, or with ``sliding_window`` W
    positions ``max(0, p-W+1)..p`` (block-table entries of blocks wholly behind
    its window, which vLLM replaces by its null block, are never read). Either
    way in KV tiles aligned at absolute position 0, so prefill, chunked prefill
    and decode give the same bits, across the window edge too.

    Args:
        q_THE: ``[T, H, E]`` queries.
        k_cache, v_cache: ``[N, S, G, E]`` paged cache holding positions ``0..p``
            (model dtype, or float8_e4m3fn read through the FP8 read rule).
        block_table_BN: int32 ``[B, max_blocks]``; row ``b`` lists sequence b's blocks.
        seq_idx_T: int ``[T]``, block-table row of each token.
        positions_T: int ``[T]``, position of each token in its own sequence.
        scale: softmax scale (``head_dim ** -0.5`` for Nemotron-H).
        k_scale, v_scale: fp32 ``[]`` KV-cache scales, required for (and only
            for) an FP8 cache.
        sliding_window: ``None`` (full causal) or W >= 1 positions including the token's own.
        sink: ``None`` (no sink: every bit as without the argument) or fp32 ``[H]``, one
            learned logit per query head that joins the softmax denominator as a column
            without a value (DeepSeek-V4, gpt-oss; :func:`~.common.check_sink`):
            ``o = sum_i e^(x_i - m) v_i / (sum_i e^(x_i - m) + e^(sink_h - m))``, added once
            after the last KV tile (or split merge) with ``m`` the row's final running max.
        compressed: ``None`` (every bit as without the argument) or a
            :class:`~.common.CompressedKV` (DeepSeek-V4 CSA/HCA; needs ``sliding_window``):
            after its window keys, row t attends the entries ``compressed.entries_TK[t]``
            (ids >= 0, in list order; -1 = none) of the ``[N, S//ratio, G, E]`` compressed
            cache (K = V, model dtype, read through ``compressed.block_table_BN``), with the
            same ``scale``, in one online softmax over window then entries; the sink joins
            the denominator once, after both. Row t's bits do not depend on K (trailing -1
            slots are exact no-ops), on other rows, on the block sizes or layouts, or on the
            step its window keys and entries were written in. Valid ids must satisfy
            ``j < (p+1)//ratio`` (entries complete at position p).

    Returns:
        ``[T, H, E]`` in ``q_THE.dtype``; row t depends only on q[t] and its
        sequence's cache over its window ``window_start(p)..positions_T[t]`` (and its
        listed compressed entries).

    Raises:
        ValueError: shape mismatch; missing, superfluous or bad scales; a bad
            ``sliding_window``; a bad ``sink``; a bad ``compressed``
            (:func:`~.common.check_compressed`); on CPU also a block size S that is not a
            multiple of the CPU KV tile (16), and an entry id that breaks causality
            (``j >= (p+1)//ratio``, naming the row) or lies past the compressed block table
            (:func:`~.common.check_compressed_entries`). The Triton kernel takes any S and
            masks such ids instead of raising (no device sync).
    """
    _check(q_THE, k_cache, v_cache, block_table_BN, seq_idx_T, positions_T)
    window = check_sliding_window("paged_attention", sliding_window)
    sink = check_sink("paged_attention", sink, q_THE.shape[1], q_THE.device)
    compressed = check_compressed("paged_attention", compressed, q_THE, k_cache, window)
    scales = check_kv_scales("paged_attention", k_cache, v_cache, k_scale, v_scale)
    ks, vs = scales if scales is not None else (None, None)
    if use_triton(q_THE):
        from .triton import paged_attention_triton

        return paged_attention_triton(q_THE, k_cache, v_cache, block_table_BN, seq_idx_T, positions_T, scale, ks, vs,
                                      sliding_window=window, sink=sink, compressed=compressed)
    return paged_attention_torch(q_THE, k_cache, v_cache, block_table_BN, seq_idx_T, positions_T, scale, ks, vs,
                                 window, sink, compressed)


def read_kv_cache(cache: torch.Tensor, slots_X: torch.Tensor) -> torch.Tensor:
    """The cache rows at ``slots_X`` (``block * S + offset``), an exact copy.

    Used to read per-token rows back from a ``PagedKVCache`` (DeepSeek-V4's compressor
    keeps its fp32 ``kv | score`` rows there, as vLLM's own DeepSeek-V4 does). The same
    torch gather runs on every device (a copy rounds nothing; indices are clamped, not
    filtered, so there is no device sync).

    Args:
        cache: ``[N, S, G, E]`` cache view (any strides; bf16/fp16/fp32, not FP8).
        slots_X: int32/int64 ``[X]``; ``< 0`` gives a zero row (padding).

    Returns:
        ``[X, G, E]`` in ``cache.dtype``.

    Raises:
        ValueError: ``cache`` not 4-D or FP8, ``slots_X`` not a 1-D int tensor on the
            cache's device; on CPU also a slot ``>= N * S``.
    """
    if cache.dim() != 4:
        raise ValueError(f"read_kv_cache: cache must be [N, S, G, E], got {tuple(cache.shape)}")
    if kv_cache_is_fp8(cache) or not cache.dtype.is_floating_point:
        raise ValueError(f"read_kv_cache: cache must be bf16/fp16/fp32 (no FP8 read rule here), got {cache.dtype}")
    if slots_X.dim() != 1 or slots_X.dtype not in (torch.int32, torch.int64) or slots_X.device != cache.device:
        raise ValueError(f"read_kv_cache: slots must be int32/int64 [X] on {cache.device}, got "
                         f"{tuple(slots_X.shape)} {slots_X.dtype} on {slots_X.device}")
    if slots_X.device.type == "cpu" and slots_X.numel() and int(slots_X.max()) >= cache.shape[0] * cache.shape[1]:
        raise ValueError(f"read_kv_cache: slot {int(slots_X.max())} is past the cache's "
                         f"{cache.shape[0]} x {cache.shape[1]} slots")
    return read_kv_cache_torch(cache, slots_X)
