"""Attention specs: causal grouped-query attention and its rotary embedding.

Forward: :mod:`unified_models.layers.attention`. State: one paged KV cache per
layer in a KV-cache group (:class:`unified_models.state.AttentionState`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .errors import SpecError

KVCacheDType = Literal["auto", "fp8_e4m3"]
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


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

    ``kv_cache_dtype``: ``"auto"`` = the cache holds K/V in the model dtype;
    ``"fp8_e4m3"`` = float8_e4m3fn with one static per-tensor scale each for K
    and V (vLLM's ``kv_cache_dtype="fp8"``): written as
    ``e4m3(clamp(fp32(k) / k_scale, -448, 448))`` (IEEE division, round to
    nearest even), read as ``q.dtype(fp32(e4m3) * k_scale)`` (same for V);
    see :func:`unified_models.ops.attention.write_kv_cache`. The scales are the
    fp32 ``[]`` parameters ``<name>.k_proj.k_scale`` and ``<name>.v_proj.v_scale``
    (ModelOpt's export names; :meth:`kv_scale_names`), required: both engines
    must quantize with the same values, so a checkpoint without them is refused
    instead of defaulting to 1.0 as vLLM's own layers do.

    ``sliding_window``: ``None`` = full causal attention; an int W >= 1 = a
    query at position p attends positions ``max(0, p-W+1)..p`` (the window
    includes the token itself, as in Mistral/vLLM). The layer's cache is then a
    sliding-window paged cache (vLLM ``SlidingWindowSpec``: blocks behind the
    window are freed).

    ``shared_kv``: K = V (MLA-style shared-KV attention): no ``v_proj``; the
    value of each position is its key (after RoPE), and the cache holds one
    tensor (vLLM ``MLAAttentionSpec``/``SlidingWindowMLASpec``). Not combined
    with an FP8 cache yet.

    ``qk_norm_eps``: ``None`` = no q/k norm; a float = per-head RMSNorm of q and
    of k over the head dim (before RoPE), with gains ``<name>.q_norm.weight [E]``
    and ``<name>.k_norm.weight [E]`` and this epsilon (Qwen3's ``q_norm`` /
    ``k_norm``, transformers ``Qwen3Attention``).
    """

    name: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: bool = False
    rope: RopeSpec | None = None
    softmax_scale: float | None = None
    kv_cache_dtype: KVCacheDType = "auto"
    sliding_window: int | None = None
    shared_kv: bool = False
    qk_norm_eps: float | None = None

    def __post_init__(self) -> None:
        eps = self.qk_norm_eps
        if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0):
            raise SpecError(f"{self.name}: qk_norm_eps={eps!r} must be None (no q/k norm) or a float >= 0")
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise SpecError(f"{self.name}: sliding_window={w!r} must be None (full attention) or an int >= 1 "
                            "(positions attended, the token's own included)")
        if not isinstance(self.shared_kv, bool):
            raise SpecError(f"{self.name}: shared_kv={self.shared_kv!r} must be a bool")
        if self.shared_kv and self.kv_cache_dtype != "auto":
            raise SpecError(f"{self.name}: shared_kv=True with kv_cache_dtype={self.kv_cache_dtype!r} is not "
                            "supported yet (a shared K = V cache has one scale; only 'auto' is implemented)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise SpecError(f"{self.name}: kv_cache_dtype={self.kv_cache_dtype!r}; known: {list(KV_CACHE_DTYPES)}")
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

    @property
    def kv_fp8(self) -> bool:
        """True when the KV cache is FP8 (e4m3) with static per-tensor scales."""
        return self.kv_cache_dtype == "fp8_e4m3"

    def kv_scale_names(self) -> tuple[str, str]:
        """HF names of the K and V cache scales (``<name>.k_proj.k_scale``, ``<name>.v_proj.v_scale``)."""
        return f"{self.name}.k_proj.k_scale", f"{self.name}.v_proj.v_scale"

    def parameter_dtypes(self) -> dict[str, torch.dtype]:
        """Tensors not stored in the model dtype: the fp32 KV-cache scales (FP8 cache only)."""
        return {n: torch.float32 for n in self.kv_scale_names()} if self.kv_fp8 else {}

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
        if self.qk_norm_eps is not None:
            shapes.update({f"{self.name}.q_norm.weight": (e,), f"{self.name}.k_norm.weight": (e,)})
        if self.shared_kv:  # V = K: no value projection
            shapes = {n: s for n, s in shapes.items() if not n.startswith(f"{self.name}.v_proj.")}
        if self.kv_fp8:
            shapes.update({n: () for n in self.kv_scale_names()})
        return shapes
