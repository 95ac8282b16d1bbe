"""Plain-PyTorch oracle built from the same spec (fp32/fp64, dense attention)."""

from .model import ReferenceModel

__all__ = ["ReferenceModel"]
