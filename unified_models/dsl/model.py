"""The whole-model spec: embedding -> residual blocks -> final norm -> LM head.

A block's ``mixer`` is one layer family's spec (one module each:
:mod:`.attention`, :mod:`.mlp`, :mod:`.mamba2`, :mod:`.moe`, ...). The forward of
each family is the function :data:`unified_models.layers.LAYERS` maps its spec
type to; adding a family = a spec module here, a layer module there, one entry
in :data:`Mixer` and one in that table.

Axis legend used in names and docstrings across the package:
T tokens (flat, packed), B sequences, H query heads, G kv heads, E head dim,
D hidden, F MLP intermediate, V vocabulary, N cache blocks, S block size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Union

import torch

from .attention import AttentionSpec
from .embedding import EmbeddingSpec, LMHeadSpec
from .errors import SpecError
from .mamba2 import Mamba2Spec
from .mlp import MLPSpec
from .moe import MoESpec
from .norm import RMSNormSpec

Mixer = Union[AttentionSpec, MLPSpec, Mamba2Spec, MoESpec]
"""The layer families a residual block may hold (each has a function in ``layers.LAYERS``)."""


@dataclass(frozen=True, kw_only=True)
class ResidualBlockSpec:
    """Pre-norm residual block: ``x + mixer(norm(x))`` (one rounding of the add).

    ``index`` is the layer index: the key of the layer's parameters' HF names
    and of its state in the state store.
    """

    index: int
    norm: RMSNormSpec
    mixer: Mixer

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        return {**self.norm.parameter_shapes(), **self.mixer.parameter_shapes()}


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

    def blocks_of(self, mixer_type: type) -> tuple[ResidualBlockSpec, ...]:
        """The blocks whose mixer is a ``mixer_type`` (subclasses included), in layer order."""
        return tuple(b for b in self.blocks if isinstance(b.mixer, mixer_type))

    @property
    def attention_blocks(self) -> tuple[ResidualBlockSpec, ...]:
        return self.blocks_of(AttentionSpec)

    @property
    def mamba_blocks(self) -> tuple[ResidualBlockSpec, ...]:
        return self.blocks_of(Mamba2Spec)

    @property
    def moe_blocks(self) -> tuple[ResidualBlockSpec, ...]:
        return self.blocks_of(MoESpec)

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

    def parameter_dtypes(self) -> dict[str, torch.dtype]:
        """All parameters, HF name -> stored dtype: ``self.dtype`` unless a
        component's ``parameter_dtypes()`` says otherwise (fp32 scales and
        router bias, ModelOpt-format uint8 / float8_e4m3fn tensors)."""
        out = {n: self.dtype for n in self.parameter_shapes()}
        for blk in self.blocks:
            for part in (blk.norm, blk.mixer):
                declared = getattr(part, "parameter_dtypes", None)
                if declared is not None:
                    out.update(declared())
        return out

    def frozen_parameter_names(self) -> set[str]:
        """Parameters that are never trained: everything a component stores in a
        dtype of its own (router correction bias, quantization scales, ModelOpt codes)."""
        out: set[str] = set()
        for blk in self.blocks:
            declared = getattr(blk.mixer, "parameter_dtypes", None)
            if declared is not None:
                out.update(declared())
        return out

    @property
    def is_packed(self) -> bool:
        """True when some weights are stored in ModelOpt's quantized format (not masters)."""
        return any(getattr(b.mixer, "checkpoint_format", "master") == "modelopt" for b in self.blocks)

    def replace(self, **changes) -> "ModelSpec":
        return dataclasses.replace(self, **changes)
