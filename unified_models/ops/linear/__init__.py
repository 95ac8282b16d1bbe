"""Linear layer ``y = x @ W^T + b``: bf16 in, fp32 accumulate, one rounding.

No split-K, no batch-size-dependent kernel choice: on GPU a Triton GEMM with
fixed tiles; on CPU exact fp64 dot products of the bf16 operands (order- and
thread-independent), rounded once, over fixed 16-row tiles.

Files (the same for every op family): ``dispatch.py`` the public ops (argument checks,
then the Triton kernel on GPU or the CPU path, see ``ops/_dispatch.py``); ``cpu.py`` the
batch-invariant plain-torch path; ``triton.py`` the Triton kernel (imported on first
use); ``reference.py`` the fp64 oracle; ``backward.py`` the autograd functions and the
differentiable entry points that :mod:`unified_models.ops` exports. :func:`round_f64`
(in ``cpu.py``), the CPU rounding rule, is shared with the FP8 linear and the MoE
experts.
"""

from .cpu import linear_torch, round_f64
from .dispatch import linear
from .reference import linear_reference

__all__ = ["linear", "linear_torch", "round_f64", "linear_reference"]
