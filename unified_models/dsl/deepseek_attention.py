"""DeepSeek-V4 attention spec: shared K = V multi-query attention with a low-rank query,
partial interleaved RoPE, a learned attention sink and a grouped low-rank output.

Forward: :mod:`unified_models.layers.deepseek_attention`. Source of the math and the
names: transformers 5.19 ``models/deepseek_v4/modeling_deepseek_v4.py``
(``DeepseekV4Attention``, ``DeepseekV4GroupedLinear``, ``apply_rotary_pos_emb``,
``eager_attention_forward``) and its checkpoint names (what ``save_pretrained`` writes,
the official DeepSeek-V4 layout: ``attn.wq_a`` ... ``attn.attn_sink``).

Only the ``sliding_attention`` layer type is implemented: a window cache, no compressor.
The CSA / HCA layer types (a compressor, an indexer, YaRN RoPE with
``compress_rope_theta``) are refused by name; they will be further fields of this spec.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import SpecError

DEEPSEEK_V4_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
"""transformers' ``DeepseekV4Config.layer_types`` values."""

SUPPORTED_LAYER_TYPES = ("sliding_attention",)

LINEARS = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
"""The linear modules of one attention sublayer (checkpoint names under the spec's ``name``)."""


@dataclass(frozen=True, kw_only=True)
class DeepseekV4AttentionSpec:
    """One DeepSeek-V4 attention sublayer (``model.layers.{i}.attn``), sliding layer type.

    Shapes: D ``hidden_size``, H ``num_heads``, E ``head_dim`` (one shared K = V head,
    G = 1), Q ``q_lora_rank``, R ``qk_rope_head_dim`` (RoPE on the last R dims of each
    head, interleaved pairs), g ``o_groups``, r ``o_lora_rank``.

    Parameters (checkpoint names under ``name``; transformers' in-memory module names
    in brackets):

    * ``wq_a.weight [Q, D]`` (``q_a_proj``), ``q_norm.weight [Q]`` (``q_a_norm``),
      ``wq_b.weight [H*E, Q]`` (``q_b_proj``): the low-rank query, then an RMS norm
      without weight per head (``q_b_norm``, eps ``rms_norm_eps``);
    * ``wkv.weight [E, D]`` (``kv_proj``), ``norm.weight [E]`` (``kv_norm``; the official
      layout calls it ``kv_norm``): the one K = V vector per token;
    * ``wo_a.weight [g*r, H*E/g]`` (``o_a_proj``, ``DeepseekV4GroupedLinear``: block g
      of rows maps head group g), ``wo_b.weight [D, g*r]`` (``o_b_proj``);
    * ``attn_sink [H]`` (``sinks``), stored and trained in fp32 (transformers keeps it
      fp32; the official checkpoints store it fp32), only with ``attention_sink``.

    Attributes:
        name: module prefix, e.g. ``model.layers.3.attn``.
        sliding_window: W positions attended, the token's own included (config ``sliding_window``).
        rope_theta: RoPE base of sliding layers (config ``rope_parameters["main"]["rope_theta"]``).
        rope_type: ``"default"`` only (sliding layers use plain RoPE; YaRN is for compressed layers).
        rms_norm_eps: eps of the three RMS norms (config ``rms_norm_eps``).
        attention_sink: the learned per-head sink in the softmax denominator (always on in
            DeepSeek-V4; ``False`` only for ablations and tests).
        layer_type: config ``layer_types[i]``; only ``"sliding_attention"``.

    Raises:
        SpecError: a compressed layer type, a RoPE type other than ``"default"``, or sizes
            that do not fit (each names the field).
    """

    name: str
    hidden_size: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    qk_rope_head_dim: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    rope_theta: float
    rms_norm_eps: float
    rope_type: str = "default"
    attention_sink: bool = True
    layer_type: str = "sliding_attention"

    def __post_init__(self) -> None:
        if self.layer_type not in SUPPORTED_LAYER_TYPES:
            known = f"one of {list(DEEPSEEK_V4_LAYER_TYPES)}" if self.layer_type not in DEEPSEEK_V4_LAYER_TYPES \
                else "a compressed layer type (CSA/HCA: compressor, indexer, YaRN RoPE), not implemented yet"
            raise SpecError(f"{self.name}: layer_type={self.layer_type!r} is {known}; supported: "
                            f"{list(SUPPORTED_LAYER_TYPES)}")
        if self.rope_type != "default":
            raise SpecError(f"{self.name}: rope_type={self.rope_type!r}: sliding_attention layers use plain RoPE "
                            "('default', theta rope_parameters['main']); YaRN with compress_rope_theta belongs to the "
                            "compressed layer types, not implemented yet")
        for f in ("hidden_size", "num_heads", "head_dim", "q_lora_rank", "qk_rope_head_dim", "o_groups",
                  "o_lora_rank", "sliding_window"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(f"{self.name}: {f}={v!r} must be an int >= 1")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            raise SpecError(f"{self.name}: qk_rope_head_dim={self.qk_rope_head_dim} must be even and at most "
                            f"head_dim={self.head_dim}")
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise SpecError(f"{self.name}: o_groups={self.o_groups} does not divide num_heads * head_dim = "
                            f"{self.num_heads * self.head_dim}")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise SpecError(f"{self.name}: rope_theta={self.rope_theta} and rms_norm_eps={self.rms_norm_eps} "
                            "must be > 0")
        if not isinstance(self.attention_sink, bool):
            raise SpecError(f"{self.name}: attention_sink={self.attention_sink!r} must be a bool")

    @property
    def scale(self) -> float:
        """Softmax scale ``head_dim ** -0.5`` (transformers' ``scaling``; no YaRN mscale)."""
        return self.head_dim ** -0.5

    @property
    def sink_name(self) -> str:
        """HF name of the per-head sink logits (``<name>.attn_sink``)."""
        return f"{self.name}.attn_sink"

    def linear_name(self, short: str) -> str:
        """Module name of one of :data:`LINEARS` (``<name>.wq_a`` ...)."""
        return f"{self.name}.{short}"

    def trainable_parameter_dtypes(self) -> dict[str, torch.dtype]:
        """The sink is stored and trained in fp32."""
        return {self.sink_name: torch.float32} if self.attention_sink else {}

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        d, h, e, q = self.hidden_size, self.num_heads, self.head_dim, self.q_lora_rank
        g, r = self.o_groups, self.o_lora_rank
        p = self.name
        shapes = {
            f"{p}.wq_a.weight": (q, d),
            f"{p}.q_norm.weight": (q,),
            f"{p}.wq_b.weight": (h * e, q),
            f"{p}.wkv.weight": (e, d),
            f"{p}.norm.weight": (e,),
            f"{p}.wo_a.weight": (g * r, h * e // g),
            f"{p}.wo_b.weight": (d, g * r),
        }
        if self.attention_sink:
            shapes[self.sink_name] = (h,)
        return shapes
