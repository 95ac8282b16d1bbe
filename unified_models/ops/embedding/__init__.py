"""Embedding lookup: ``out[t] = weight[input_ids[t]]`` (an exact copy).

Files (the same for every op family): ``dispatch.py`` the public ops (argument checks,
then the Triton kernel on GPU or the CPU path, see ``ops/_dispatch.py``); ``cpu.py`` the
batch-invariant plain-torch path; ``triton.py`` the Triton kernel (imported on first
use); ``reference.py`` the fp64 oracle; ``backward.py`` the autograd functions and the
differentiable entry points that :mod:`unified_models.ops` exports.
"""

from .cpu import embedding_torch
from .dispatch import embedding
from .reference import embedding_reference

__all__ = ["embedding", "embedding_torch", "embedding_reference"]
