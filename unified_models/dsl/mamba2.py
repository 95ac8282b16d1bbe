"""Mamba-2 mixer spec (Nemotron-H ``M`` layers).

Forward: :mod:`unified_models.layers.mamba2`. State: one per-request state slot
per layer in the Mamba state group (:class:`unified_models.state.MambaState`,
layout :class:`unified_models.ops.Mamba2State`).

Names are those of transformers' ``NemotronHMamba2Mixer`` (and vLLM's
``MambaMixer2``): ``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``,
``norm``, ``out_proj``.

Shapes: D hidden, H heads, P head dim, G groups (B/C), N state size,
F = H*P (``d_inner``), C = F + 2*G*N conv channels, W conv width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from .errors import SpecError

QUANTIZABLE_PROJS = ("in_proj", "out_proj")
"""The linears a checkpoint may quantize (FP8 W8A8 in the published NVFP4 hybrids)."""


@dataclass(frozen=True, kw_only=True)
class Mamba2Spec:
    """Mamba-2 mixer (SSD), ``y = out_proj(gated_norm(scan(conv(xBC)), z))``.

    ``in_proj [2F + 2GN + H, D]`` splits into ``z [F]`` (gate), ``xBC [C]``
    (conv input) and ``dt [H]``; ``conv1d.weight [C, 1, W]`` (+ ``bias [C]``
    when ``use_conv_bias``); ``dt_bias``, ``A_log``, ``D [H]``;
    ``norm.weight [F]`` (grouped gated RMSNorm, group size ``F // G``, gate
    before the norm); ``out_proj [D, F]``. ``in_proj``/``out_proj`` carry a
    bias when ``use_bias`` (transformers: ``config.use_bias``).

    ``time_step_limit`` is the config's ``(lo, hi)`` dt clamp (default
    ``(0, inf)``, as vLLM and mamba_ssm). ``chunk_size`` Q: chunks of the
    scan are aligned at absolute positions ``[kQ, (k+1)Q)`` of each sequence.

    ``in_proj``/``out_proj`` may have a weight format (``ModelSpec.weight_formats``:
    FP8 W8A8 in the published NVFP4 hybrids); the spec itself declares them in
    the model dtype.
    """

    name: str
    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    ssm_state_size: int
    conv_kernel: int
    chunk_size: int
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    eps: float = 1e-5
    use_conv_bias: bool = True
    use_bias: bool = False
    activation: str = "silu"

    def __post_init__(self) -> None:
        for field in ("hidden_size", "num_heads", "head_dim", "n_groups", "ssm_state_size", "conv_kernel",
                      "chunk_size"):
            v = getattr(self, field)
            if not isinstance(v, int) or v < 1:
                raise SpecError(f"{self.name}: {field}={v!r} must be an integer >= 1")
        if self.chunk_size < 2:
            # the decode state holds the chunk's pending rows (chunk_size - 1 of them)
            raise SpecError(f"{self.name}: chunk_size={self.chunk_size} must be >= 2 (the decode state holds "
                            "chunk_size - 1 pending rows of the current chunk)")
        if self.num_heads % self.n_groups:
            raise SpecError(f"{self.name}: mamba num_heads={self.num_heads} is not a multiple of "
                            f"n_groups={self.n_groups}")
        if self.activation != "silu":
            raise SpecError(f"{self.name}: mamba_hidden_act={self.activation!r}; only 'silu' is supported")
        lo, hi = (float(v) for v in self.time_step_limit)
        if not (lo >= 0 and hi >= lo) or math.isnan(lo) or math.isnan(hi):
            raise SpecError(f"{self.name}: time_step_limit={tuple(self.time_step_limit)} must be 0 <= lo <= hi")
        object.__setattr__(self, "time_step_limit", (lo, hi))

    @property
    def intermediate_size(self) -> int:
        """F = ``num_heads * head_dim`` (``d_inner``)."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """C = F + 2*G*N (channels of the conv: x, B, C)."""
        return self.intermediate_size + 2 * self.n_groups * self.ssm_state_size

    @property
    def in_proj_size(self) -> int:
        """Rows of ``in_proj``: ``z [F] | xBC [C] | dt [H]``."""
        return self.intermediate_size + self.conv_dim + self.num_heads

    @property
    def group_size(self) -> int:
        """Features per group of the gated RMSNorm: ``F // G``."""
        return self.intermediate_size // self.n_groups

    def state_kwargs(self) -> dict[str, int]:
        """Keyword arguments of ``ops.Mamba2State.shapes`` / ``allocate`` for this layer."""
        return dict(num_heads=self.num_heads, head_dim=self.head_dim, n_groups=self.n_groups,
                    state_size=self.ssm_state_size, conv_width=self.conv_kernel, chunk_size=self.chunk_size)

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        d, f, c, h, w = self.hidden_size, self.intermediate_size, self.conv_dim, self.num_heads, self.conv_kernel
        p = self.name
        shapes = {f"{p}.in_proj.weight": (self.in_proj_size, d)}
        if self.use_bias:
            shapes[f"{p}.in_proj.bias"] = (self.in_proj_size,)
        shapes[f"{p}.conv1d.weight"] = (c, 1, w)
        if self.use_conv_bias:
            shapes[f"{p}.conv1d.bias"] = (c,)
        shapes.update({
            f"{p}.dt_bias": (h,),
            f"{p}.A_log": (h,),
            f"{p}.D": (h,),
            f"{p}.norm.weight": (f,),
            f"{p}.out_proj.weight": (d, f),
        })
        if self.use_bias:
            shapes[f"{p}.out_proj.bias"] = (d,)
        return shapes
