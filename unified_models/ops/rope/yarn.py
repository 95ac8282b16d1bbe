"""YaRN inverse frequencies (Peng et al. 2023, "YaRN: Efficient Context Window Extension of
Large Language Models", arXiv 2309.00071), as transformers 5.19 computes them
(``modeling_rope_utils._compute_yarn_parameters``), in fp32, bit for bit.

For rotary dim R, base theta, factor s, original length L and ramp bounds
(beta_fast, beta_slow): with ``f_i = theta^(2i/R)`` (fp32),
``extra_i = 1 / f_i``, ``inter_i = 1 / (s f_i)``, the correction range
``low = R ln(L / (2 pi beta_fast)) / (2 ln theta)``, ``high`` likewise with beta_slow
(floored / ceiled when ``truncate``, clamped to ``[0, R-1]``; a degenerate range gets
``high += 0.001``), the ramp ``g_i = clamp((i - low) / (high - low), 0, 1)`` and
``e_i = 1 - g_i``: ``inv_freq_i = inter_i (1 - e_i) + extra_i e_i``. The same torch fp32
operations in the same order as transformers, on the CPU (the values are then moved), so
the tables are the same wherever they are built.
"""

from __future__ import annotations

import math

import torch


def _correction_range(beta_fast: float, beta_slow: float, dim: int, base: float, original_max: int,
                      truncate: bool) -> tuple[float, float]:
    def corr(num_rotations):
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr(beta_fast), corr(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_inv_freq(rotary_dim: int, theta: float, factor: float, original_max_position_embeddings: int,
                  beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True) -> torch.Tensor:
    """fp32 ``[R/2]`` YaRN inverse frequencies (module docstring), bitwise transformers'.

    Args:
        rotary_dim: R (even, > 0): ``int(head_dim * partial_rotary_factor)`` = ``qk_rope_head_dim``.
        theta: RoPE base (> 1).
        factor: s (> 0).
        original_max_position_embeddings: L (> 0).
        beta_fast, beta_slow: ramp bounds (> 0).
        truncate: floor/ceil the correction range.

    Returns:
        CPU fp32 ``[R/2]``.

    Raises:
        ValueError: a bad argument (named).
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"yarn: rotary_dim must be a positive even number, got {rotary_dim}")
    if not theta > 1 or not factor > 0 or not original_max_position_embeddings > 0:
        raise ValueError(f"yarn: theta ({theta}) must be > 1, factor ({factor}) and "
                         f"original_max_position_embeddings ({original_max_position_embeddings}) > 0")
    if not beta_fast > 0 or not beta_slow > 0:
        raise ValueError(f"yarn: beta_fast ({beta_fast}) and beta_slow ({beta_slow}) must be > 0")
    dim, base = int(rotary_dim), float(theta)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    low, high = _correction_range(beta_fast, beta_slow, dim, base, original_max_position_embeddings, truncate)
    if low == high:
        high += 0.001  # transformers: prevent the singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    return inv_freq_interpolation * (1 - extrapolation_factor) + inv_freq_extrapolation * extrapolation_factor


def yarn_inv_freq_reference(rotary_dim: int, theta: float, factor: float, original_max_position_embeddings: int,
                            beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True) -> torch.Tensor:
    """fp64 oracle of :func:`yarn_inv_freq` (the same formula, every step in fp64): ``[R/2]``."""
    dim, base = int(rotary_dim), float(theta)
    f = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    low, high = _correction_range(beta_fast, beta_slow, dim, base, original_max_position_embeddings, truncate)
    if low == high:
        high += 0.001
    e = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
    return (1.0 / (factor * f)) * (1 - e) + (1.0 / f) * e
