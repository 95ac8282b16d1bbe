"""The FP8 KV-cache rule and the KV-scale checks, shared by the attention kernel
(:mod:`.triton`), its CPU path, its oracle, the backward and the engines' caches
(the rule itself: :mod:`unified_models.ops.attention`)."""

from __future__ import annotations

import math

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
