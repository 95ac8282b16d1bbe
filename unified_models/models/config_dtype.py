"""The model dtype a Hugging Face config declares (shared by the family declarations)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["config_dtype"]


def config_dtype(config: Any, dtype: torch.dtype | None) -> torch.dtype:
    """``dtype`` when given, else the config's ``dtype`` / ``torch_dtype`` (a ``torch.dtype`` or its
    name) when it names a floating-point dtype, else ``torch.bfloat16``."""
    if dtype is not None:
        return dtype
    cfg = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(cfg, str):
        cfg = getattr(torch, cfg, None)
    return cfg if isinstance(cfg, torch.dtype) and cfg.is_floating_point else torch.bfloat16
