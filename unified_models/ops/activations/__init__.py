"""MLP activations, fp32 math rounded once.

* relu2: ``relu(x)^2`` (Nemotron-H ``mlp_hidden_act="relu2"``, So et al. 2021 "Primer").
* swiglu: ``silu(gate) * up`` (Shazeer 2020), rounded once before any quantization.

Files (the same for every op family): ``dispatch.py`` the public ops (argument checks,
then the Triton kernel on GPU or the CPU path, see ``ops/_dispatch.py``); ``cpu.py`` the
batch-invariant plain-torch path; ``triton.py`` the Triton kernel (imported on first
use); ``reference.py`` the fp64 oracle; ``backward.py`` the autograd functions and the
differentiable entry points that :mod:`unified_models.ops` exports.
"""

from .cpu import relu2_torch, swiglu_torch
from .dispatch import relu2, swiglu
from .reference import relu2_reference, swiglu_reference

__all__ = ["relu2", "swiglu", "relu2_torch", "swiglu_torch", "relu2_reference", "swiglu_reference"]
