"""RMSNorm: ``y = x * rsqrt(mean(x^2) + eps) * w`` in fp32, rounded once.

Source: Zhang & Sennrich 2019; transformers ``NemotronHRMSNorm`` (which also
keeps the weight multiply in fp32 and casts once). ``add_rms_norm`` is the residual
add fused in front of it (vLLM ``_custom_ops.fused_add_rms_norm``), bitwise the two ops.

Files (the same for every op family): ``dispatch.py`` the public ops (argument checks,
then the Triton kernel on GPU or the CPU path, see ``ops/_dispatch.py``); ``cpu.py`` the
batch-invariant plain-torch path; ``triton.py`` the Triton kernel (imported on first
use); ``reference.py`` the fp64 oracle; ``backward.py`` the autograd functions and the
differentiable entry points that :mod:`unified_models.ops` exports.
"""

from .cpu import add_rms_norm_torch, rms_norm_torch
from .dispatch import add_rms_norm, rms_norm
from .reference import add_rms_norm_reference, rms_norm_reference

__all__ = ["rms_norm", "rms_norm_torch", "rms_norm_reference", "add_rms_norm", "add_rms_norm_torch",
           "add_rms_norm_reference"]
