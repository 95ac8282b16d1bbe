"""The FP8 KV-cache rule and the KV-scale checks, shared by the attention kernel
(:mod:`.triton`), its CPU path, its oracle, the backward and the engines' caches
(the rule itself: :mod:`unified_models.ops.attention`); the argument checks of the
window, the sink and the compressed entries (:class:`CompressedKV`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


KV_FP8_DTYPE = torch.float8_e4m3fn
"""Element type of an FP8 KV cache (vLLM allocates uint8; engines view it as this)."""

FP8_E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value: the write saturates to +-448."""


def kv_cache_is_fp8(cache: torch.Tensor) -> bool:
    """True for a float8_e4m3fn cache (which needs ``k_scale``/``v_scale``)."""
    return cache.dtype == KV_FP8_DTYPE


def check_kv_scales(what: str, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Validate the KV-cache scales against the cache dtype.

    Returns:
        ``(k_scale, v_scale)`` as 0-d fp32 tensors for a float8_e4m3fn cache,
        ``None`` for a model-dtype cache.

    Raises:
        ValueError: an FP8 cache without both scales, scales for a
            model-dtype cache, K and V caches of different dtypes, a scale that
            is not a one-element fp32 tensor on the cache's device, or (scales
            on the CPU) a scale that is zero, negative, NaN or Inf. On CUDA the
            values are not read here (no device sync per layer); the engines'
            loaders refuse such checkpoints.
    """
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{what}: k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    if not kv_cache_is_fp8(k_cache):
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"{what}: k_scale/v_scale are only used with a float8_e4m3fn KV cache; "
                             f"this cache is {k_cache.dtype}")
        return None
    out = []
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc is None:
            raise ValueError(f"{what}: a float8_e4m3fn KV cache needs k_scale and v_scale (fp32 scalars); "
                             f"{name} is missing")
        if not isinstance(sc, torch.Tensor) or sc.dtype != torch.float32 or sc.numel() != 1:
            desc = f"{tuple(sc.shape)} {sc.dtype}" if isinstance(sc, torch.Tensor) else type(sc).__name__
            raise ValueError(f"{what}: {name} must be a one-element fp32 tensor (shape [] or [1]), got {desc}")
        if sc.device != k_cache.device:
            raise ValueError(f"{what}: {name} is on {sc.device}, the cache on {k_cache.device}")
        if sc.device.type == "cpu":
            val = float(sc.reshape(()))
            if not (math.isfinite(val) and val > 0):
                raise ValueError(f"{what}: {name}={val} must be finite and > 0")
        out.append(sc.reshape(()))
    return out[0], out[1]


def kv_fp8_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The FP8 KV write rule in torch: ``e4m3(clamp(fp32(x) / scale, -448, 448))``.

    Args:
        x: any float tensor (K or V rows).
        scale: 0-d fp32 (> 0).

    Returns:
        float8_e4m3fn tensor of ``x``'s shape (IEEE division, RNE; NaN stays NaN).
    """
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(KV_FP8_DTYPE)


def kv_fp8_dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The FP8 KV read rule in torch: ``dtype(fp32(codes) * scale)``."""
    return (codes.float() * scale).to(dtype)


def kv_fp8_roundtrip(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the attention reads back after writing ``x`` into an FP8 cache (no gradient rule)."""
    return kv_fp8_dequantize(kv_fp8_quantize(x, scale), scale, dtype)


def check_sliding_window(what: str, sliding_window: int | None) -> int | None:
    """Validate a sliding window: ``None`` (full causal attention) or an int W >= 1.

    Raises:
        ValueError: W is not an int or is < 1 (names the value).
    """
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"{what}: sliding_window must be None or an int >= 1, got {sliding_window!r}")
    return sliding_window


def check_sink(what: str, sink_H: torch.Tensor | None, num_heads: int, device: torch.device) -> torch.Tensor | None:
    """Validate an attention sink: ``None`` (no sink) or one fp32 logit per query head.

    The sink ``s_h`` is a learned logit that joins each query row's softmax as one extra
    column without a value (gpt-oss / DeepSeek-V4, transformers' ``eager_attention_forward``
    concatenates it to the scores and drops its column after the softmax):
    ``o = sum_i exp(x_i - m) v_i / (sum_i exp(x_i - m) + exp(s_h - m))``, ``x_i`` the scaled
    scores; it is not multiplied by the softmax scale.

    Raises:
        ValueError: not a float32 tensor of shape ``[num_heads]`` on ``device`` (names what it got).
    """
    if sink_H is None:
        return None
    if not isinstance(sink_H, torch.Tensor) or sink_H.dtype != torch.float32 or tuple(sink_H.shape) != (num_heads,):
        desc = f"{tuple(sink_H.shape)} {sink_H.dtype}" if isinstance(sink_H, torch.Tensor) else type(sink_H).__name__
        raise ValueError(f"{what}: sink must be a float32 tensor of shape [{num_heads}] (one logit per query head), "
                         f"got {desc}")
    if sink_H.device != torch.device(device):
        raise ValueError(f"{what}: sink is on {sink_H.device}, the queries on {device}")
    return sink_H


def window_start(positions: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """First position each token reads: ``max(0, p - W + 1)`` (``0`` without a window).

    A token at position p attends positions ``window_start(p)..p`` (W positions
    once p >= W - 1; Mistral/vLLM convention: the window includes the token itself).
    """
    if sliding_window is None:
        return torch.zeros_like(positions)
    return (positions - (sliding_window - 1)).clamp(min=0)


@dataclass(frozen=True, eq=False)
class CompressedKV:
    """The compressed entries a :func:`ops.paged_attention` row attends after its window
    (DeepSeek-V4 CSA / HCA; transformers ``DeepseekV4Attention`` concatenates the
    compressor's entries after the sliding-window keys, K = V).

    Attributes:
        cache: ``[N, S // ratio, G, E]`` pages of the layer's ``CompressedKVCache`` (any
            strides; G and E those of the window cache; bf16/fp16/fp32, not FP8): entry
            ``j`` of sequence ``b`` is page ``block_table_BN[b, j // (S // ratio)]``, offset
            ``j % (S // ratio)`` (the rule of :func:`unified_models.state.entry_slots`:
            block ``j*ratio // S``, offset ``(j*ratio % S) // ratio``). K = V.
        ratio: m, tokens per entry; entry ``j`` covers positions ``m*j .. m*j + m - 1`` and
            a token at position ``p`` may attend it only if ``j < (p + 1) // m``.
        entries_TK: int32/int64 ``[T, K]``: row t's entry ids in the order they are attended,
            the valid ids (>= 0) first, then -1 (no entry; any K, 0 included).
        block_table_BN: int ``[B, max_blocks]`` of the compressed cache's KV-cache group
            (rows indexed by the attention's ``seq_idx_T``).
    """

    cache: torch.Tensor
    ratio: int
    entries_TK: torch.Tensor
    block_table_BN: torch.Tensor


_INDEX_DTYPES = (torch.int32, torch.int64)
_COMPRESSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_compressed(what: str, compressed: CompressedKV | None, q_THE: torch.Tensor, k_cache: torch.Tensor,
                     sliding_window: int | None) -> CompressedKV | None:
    """Validate the ``compressed=`` argument of paged attention (shapes, dtypes, devices; no
    values read, so no device sync).

    Raises:
        ValueError: not a :class:`CompressedKV`; ``sliding_window`` is ``None`` (compressed
            attention is DeepSeek-V4's window + entries); ``ratio`` not an int >= 1; a cache
            that is not ``[N, S', G, E]`` with the window cache's G and the queries' E, or is
            not bf16/fp16/fp32 (FP8 compressed caches are not supported); ``entries_TK`` not
            int32/int64 ``[T, K]``; a block table that is not a 2-D int tensor; a tensor on
            another device than the queries.
    """
    if compressed is None:
        return None
    if not isinstance(compressed, CompressedKV):
        raise ValueError(f"{what}: compressed must be a CompressedKV, got {type(compressed).__name__}")
    if sliding_window is None:
        raise ValueError(f"{what}: compressed= needs sliding_window (DeepSeek-V4 attends its window, then the "
                         "compressed entries)")
    r = compressed.ratio
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{what}: compressed.ratio must be an int >= 1, got {r!r}")
    c, ent, bt = compressed.cache, compressed.entries_TK, compressed.block_table_BN
    t, _, e = q_THE.shape
    g = k_cache.shape[2]
    if not isinstance(c, torch.Tensor) or c.dim() != 4 or c.shape[2] != g or c.shape[3] != e:
        desc = tuple(c.shape) if isinstance(c, torch.Tensor) else type(c).__name__
        raise ValueError(f"{what}: compressed.cache must be [N, S//ratio, {g}, {e}] (the window cache's kv heads, "
                         f"the queries' head dim), got {desc}")
    if c.shape[1] < 1:
        raise ValueError(f"{what}: compressed.cache has no entry per page (S//ratio = 0); the block size S must be "
                         f"a multiple of ratio={r}")
    if c.dtype not in _COMPRESSED_DTYPES:
        raise ValueError(f"{what}: compressed.cache must be bf16/fp16/fp32 (no FP8 compressed cache), got {c.dtype}")
    if not isinstance(ent, torch.Tensor) or ent.dim() != 2 or ent.shape[0] != t or ent.dtype not in _INDEX_DTYPES:
        desc = f"{tuple(ent.shape)} {ent.dtype}" if isinstance(ent, torch.Tensor) else type(ent).__name__
        raise ValueError(f"{what}: compressed.entries_TK must be int32/int64 [{t}, K], got {desc}")
    if not isinstance(bt, torch.Tensor) or bt.dim() != 2 or bt.dtype not in _INDEX_DTYPES:
        desc = f"{tuple(bt.shape)} {bt.dtype}" if isinstance(bt, torch.Tensor) else type(bt).__name__
        raise ValueError(f"{what}: compressed.block_table_BN must be an int32/int64 [B, max_blocks], got {desc}")
    for name, x in (("cache", c), ("entries_TK", ent), ("block_table_BN", bt)):
        if x.device != q_THE.device:
            raise ValueError(f"{what}: compressed.{name} is on {x.device}, the queries on {q_THE.device}")
    return compressed


def check_compressed_entries(what: str, compressed: CompressedKV, positions_T: torch.Tensor) -> None:
    """Check the entry ids against causality and the block table (reads the values: the CPU
    path and the oracles call it; the Triton kernel masks such ids instead).

    Raises:
        ValueError: a valid id (>= 0) of row t with ``j >= (p_t + 1) // ratio`` (an entry the
            token may not attend yet: it is not complete at position ``p_t``; a padding row,
            ``p_t < 0``, may list none), or whose page ``j // (S // ratio)`` lies past the
            block table's width. Names the row, its position and the id.
    """
    ent = compressed.entries_TK.long()
    if ent.numel() == 0:
        return
    pos = positions_T.long()
    limit = torch.where(pos >= 0, (pos + 1).div(compressed.ratio, rounding_mode="floor"), 0)
    bad = (ent >= 0) & (ent >= limit.view(-1, 1))
    if bool(bad.any()):
        t, k = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{what}: row {t} (position {int(pos[t])}) lists compressed entry {int(ent[t, k])}, "
                         f"but a token at position p may attend only entries j < (p+1)//{compressed.ratio} = "
                         f"{int(limit[t])} (the complete ones)")
    width = compressed.block_table_BN.shape[1] * compressed.cache.shape[1]
    far = ent >= width
    if bool(far.any()):
        t, k = (int(i) for i in far.nonzero()[0])
        raise ValueError(f"{what}: row {t} lists compressed entry {int(ent[t, k])}, past the compressed block "
                         f"table's {compressed.block_table_BN.shape[1]} pages x {compressed.cache.shape[1]} entries")


def compressed_entry_slots(compressed: CompressedKV, seq_idx_T: torch.Tensor) -> torch.Tensor:
    """int64 ``[T, K]``: cache slot (``page * (S // ratio) + offset``) of each listed entry,
    ``-1`` where the id is ``-1`` (no block-table entry is read there)."""
    ent = compressed.entries_TK.long()
    sc = compressed.cache.shape[1]
    valid = ent >= 0
    e0 = torch.where(valid, ent, 0)
    col = (e0 // sc).clamp(max=max(compressed.block_table_BN.shape[1] - 1, 0))
    rows = compressed.block_table_BN[seq_idx_T.long().clamp(min=0)].long()  # [T, nb]
    blk = rows.gather(1, col) if ent.shape[1] else col
    return torch.where(valid, blk * sc + e0 % sc, -1)
