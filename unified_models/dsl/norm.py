"""Normalisation specs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RMSNormSpec:
    """RMSNorm ``y = x * rsqrt(mean(x^2) + eps) * w`` (fp32 math, one rounding).

    ``weight [D]``. Source: Zhang & Sennrich 2019; transformers ``NemotronHRMSNorm``.
    """

    name: str
    hidden_size: int
    eps: float

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        return {f"{self.name}.weight": (self.hidden_size,)}
