"""Attention specs: causal grouped-query attention and its rotary embedding.

Forward: :mod:`unified_models.layers.attention`. State: one paged KV cache per
layer in a KV-cache group (:class:`unified_models.state.AttentionState`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import SpecError


@dataclass(frozen=True, kw_only=True)
class RopeSpec:
    """Rotary position embedding (neox layout), ``theta`` = config ``rope_theta``."""

    theta: float
    rotary_dim: int

    def __post_init__(self) -> None:
        if self.rotary_dim <= 0 or self.rotary_dim % 2 or self.theta <= 0:
            raise SpecError(f"RoPE needs an even rotary_dim > 0 and theta > 0, got {self.rotary_dim}, {self.theta}")


@dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """Causal grouped-query attention over a paged KV cache.

    ``q_proj [H*E, D]``, ``k_proj``/``v_proj [G*E, D]``, ``o_proj [D, H*E]``;
    softmax scale ``E ** -0.5`` unless ``softmax_scale`` is given.
    """

    name: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: bool = False
    rope: RopeSpec | None = None
    softmax_scale: float | None = None

    def __post_init__(self) -> None:
        if self.rope is not None and self.rope.rotary_dim > self.head_dim:
            raise SpecError(f"{self.name}: rotary_dim={self.rope.rotary_dim} exceeds head_dim={self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise SpecError(
                f"{self.name}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )

    @property
    def scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else self.head_dim**-0.5

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        h, g, e, d = self.num_heads, self.num_kv_heads, self.head_dim, self.hidden_size
        shapes = {
            f"{self.name}.q_proj.weight": (h * e, d),
            f"{self.name}.k_proj.weight": (g * e, d),
            f"{self.name}.v_proj.weight": (g * e, d),
            f"{self.name}.o_proj.weight": (d, h * e),
        }
        if self.bias:
            shapes.update({
                f"{self.name}.q_proj.bias": (h * e,),
                f"{self.name}.k_proj.bias": (g * e,),
                f"{self.name}.v_proj.bias": (g * e,),
                f"{self.name}.o_proj.bias": (d,),
            })
        return shapes
