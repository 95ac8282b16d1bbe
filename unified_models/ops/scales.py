"""Checks of one-element quantization scales, shared by the NVFP4, FP8 and KV-cache loaders."""

from __future__ import annotations

import torch


def scalar_scale_problems(name: str, t: torch.Tensor | None, *, allow_1d: bool = False,
                          required: bool = False) -> list[str]:
    """What is wrong with a per-tensor scale (empty list: nothing).

    Args:
        name: the tensor's name in the messages.
        t: the scale, or None when absent.
        allow_1d: accept shape ``[1]`` as well as ``[]``.
        required: report an absent scale (otherwise None is fine).

    Returns:
        Messages for: missing (``required``), dtype other than float32, more
        than one element, NaN, +-Inf, zero, negative.
    """
    if t is None:
        return [f"{name} is missing"] if required else []
    out = []
    if t.dtype != torch.float32:
        out.append(f"{name} has dtype {t.dtype}, expected torch.float32")
    if t.numel() != 1 or t.dim() > (1 if allow_1d else 0):
        out.append(f"{name} must be a scalar{' ([] or [1])' if allow_1d else ''}, got shape {list(t.shape)}")
        return out
    v = float(t.float().reshape(()))
    if v != v:
        out.append(f"{name} is NaN")
    elif v in (float("inf"), float("-inf")):
        out.append(f"{name} is {v}")
    elif v == 0:
        out.append(f"{name} is zero")
    elif v < 0:
        out.append(f"{name} is negative ({v})")
    return out
