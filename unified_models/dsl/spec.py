"""Declarative model specs: frozen, keyword-only dataclasses.

A spec says *what* a model computes (layer types, widths, which activation,
which parameters exist and under which Hugging Face names); the kernels that
compute it live in :mod:`unified_models.ops` and the engine adapters in
:mod:`unified_models.backends`. Every engine builds its parameters from
:meth:`ModelSpec.parameter_shapes`, so the three backends can never disagree
on names or shapes.

Axis legend used in names and docstrings across the package:
T tokens (flat, packed), B sequences, H query heads, G kv heads, E head dim,
D hidden, F MLP intermediate, V vocabulary, N cache blocks, S block size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Union

import torch

from .errors import SpecError

Activation = Literal["relu2", "swiglu"]


@dataclass(frozen=True, kw_only=True)
class EmbeddingSpec:
    """Token embedding table ``weight [V, D]`` (HF name ``<prefix>.weight``)."""

    name: str
    vocab_size: int
    hidden_size: int

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        return {f"{self.name}.weight": (self.vocab_size, self.hidden_size)}


@dataclass(frozen=True, kw_only=True)
class RMSNormSpec:
    """RMSNorm ``y = x * rsqrt(mean(x^2) + eps) * w`` (fp32 math, one rounding).

    Source: Zhang & Sennrich 2019; transformers ``NemotronHRMSNorm``.
    """

    name: str
    hidden_size: int
    eps: float

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        return {f"{self.name}.weight": (self.hidden_size,)}


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


@dataclass(frozen=True, kw_only=True)
class MLPSpec:
    """Dense MLP.

    ``relu2``: ``down(relu(up(x))^2)`` (Nemotron-H, ``mlp_hidden_act="relu2"``).
    ``swiglu``: ``down(silu(gate(x)) * up(x))`` (Llama/DeepSeek).
    """

    name: str
    hidden_size: int
    intermediate_size: int
    activation: Activation
    bias: bool = False

    def __post_init__(self) -> None:
        if self.activation not in ("relu2", "swiglu"):
            raise SpecError(f"{self.name}: unknown MLP activation {self.activation!r}")

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        d, f = self.hidden_size, self.intermediate_size
        shapes = {
            f"{self.name}.up_proj.weight": (f, d),
            f"{self.name}.down_proj.weight": (d, f),
        }
        if self.activation == "swiglu":
            shapes[f"{self.name}.gate_proj.weight"] = (f, d)
        if self.bias:
            shapes[f"{self.name}.up_proj.bias"] = (f,)
            shapes[f"{self.name}.down_proj.bias"] = (d,)
            if self.activation == "swiglu":
                shapes[f"{self.name}.gate_proj.bias"] = (f,)
        return shapes


Mixer = Union[AttentionSpec, MLPSpec]


@dataclass(frozen=True, kw_only=True)
class ResidualBlockSpec:
    """Pre-norm residual block: ``x + mixer(norm(x))`` (one rounding of the add)."""

    index: int
    norm: RMSNormSpec
    mixer: Mixer

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        return {**self.norm.parameter_shapes(), **self.mixer.parameter_shapes()}


@dataclass(frozen=True, kw_only=True)
class LMHeadSpec:
    """Output projection ``weight [V, D]``; ``tied`` reuses the embedding table."""

    name: str
    vocab_size: int
    hidden_size: int
    tied_to: str | None = None

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        if self.tied_to is not None:
            return {}
        return {f"{self.name}.weight": (self.vocab_size, self.hidden_size)}

    @property
    def weight_name(self) -> str:
        return self.tied_to if self.tied_to is not None else f"{self.name}.weight"


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A whole causal LM: embedding -> residual blocks -> final norm -> LM head.

    ``architecture`` is the name our vLLM plugin registers; ``hf_model_type``
    and ``hf_architecture`` say which transformers class is the peer.
    """

    family: str
    architecture: str
    hf_model_type: str
    hf_architecture: str
    embedding: EmbeddingSpec
    blocks: tuple[ResidualBlockSpec, ...]
    final_norm: RMSNormSpec
    lm_head: LMHeadSpec
    dtype: torch.dtype = torch.bfloat16
    max_position_embeddings: int = 4096
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for i, block in enumerate(self.blocks):
            if block.index != i:
                raise SpecError(f"block {i} carries index {block.index}")

    @property
    def vocab_size(self) -> int:
        return self.embedding.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.embedding.hidden_size

    @property
    def attention_blocks(self) -> tuple[ResidualBlockSpec, ...]:
        return tuple(b for b in self.blocks if isinstance(b.mixer, AttentionSpec))

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """All parameters, HF name -> shape, in model order.

        Raises:
            SpecError: two components declare the same parameter name.
        """
        shapes: dict[str, tuple[int, ...]] = {}
        parts = [self.embedding, *self.blocks, self.final_norm, self.lm_head]
        for part in parts:
            for name, shape in part.parameter_shapes().items():
                if name in shapes:
                    raise SpecError(f"parameter {name} declared twice")
                shapes[name] = shape
        return shapes

    def replace(self, **changes) -> "ModelSpec":
        return dataclasses.replace(self, **changes)
