"""Rotary position embedding (RoPE), neox layout (rotate-half).

Source: Su et al. 2021, "RoFormer"; the neox layout of transformers'
``rotate_half`` / ``apply_rotary_pos_emb``: with ``x1 = x[..., :R/2]`` and
``x2 = x[..., R/2:R]`` (R = rotary dim), ``out1 = x1 cos - x2 sin``,
``out2 = x2 cos + x1 sin``; dims past R pass through.

The cos/sin table is computed once per (positions, R, theta, device) in fp64
and rounded to fp32, with one fixed-shape call, so a token's angles depend only
on its position (never on the batch). YaRN (``yarn.py``, DeepSeek-V4's compressed
layers): the inverse frequencies bitwise as transformers computes them in fp32
(:func:`yarn_inv_freq`), the tables from them as above (:func:`rope_cos_sin_yarn`).
Application is elementwise in fp32 with one rounding.

Files (the same for every op family): ``dispatch.py`` the public ops (argument checks,
then the Triton kernel on GPU or the CPU path, see ``ops/_dispatch.py``); ``cpu.py`` the
batch-invariant plain-torch path; ``triton.py`` the Triton kernel (imported on first
use); ``reference.py`` the fp64 oracle; ``backward.py`` the autograd functions and the
differentiable entry points that :mod:`unified_models.ops` exports.
"""

from .cpu import apply_rope_torch
from .dispatch import apply_rope, rope_cos_sin, rope_cos_sin_yarn
from .reference import apply_rope_reference
from .yarn import yarn_inv_freq, yarn_inv_freq_reference

__all__ = ["rope_cos_sin", "rope_cos_sin_yarn", "apply_rope", "apply_rope_torch", "apply_rope_reference",
           "yarn_inv_freq", "yarn_inv_freq_reference"]
