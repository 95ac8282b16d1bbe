"""Helpers shared by the families' backward modules (``ops/<family>/backward.py``).

:func:`acc` and :func:`_cast` pick the backward's accumulation dtype and cast a
gradient back to its input's dtype; :func:`needs_grad` decides whether an entry
point builds a graph at all.
"""

from __future__ import annotations

import torch


def acc(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the backward's accumulation dtype: fp64 stays fp64, else fp32."""
    return t.double() if t.dtype == torch.float64 else t.float()


def _cast(g: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return None if g is None or like is None else g.to(like.dtype)


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """True when grad mode is on and one of ``tensors`` requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
