"""The whole-model spec: embedding -> blocks of sublayers -> final norm -> LM head.

A block (:class:`BlockSpec`, one per layer) is an ordered tuple of sublayers
(:class:`SublayerSpec`: a norm and a mixer); the model's residual policy
(:mod:`.residual`) owns the stream between them. A sublayer's ``mixer`` is one
layer family's spec (one module each: :mod:`.attention`, :mod:`.mlp`,
:mod:`.mamba2`, :mod:`.moe`, ...); everything an engine needs to know about a
family (its forward, oracle, caches, init, Megatron fields) is the
:class:`unified_models.layers.LayerFamily` registered for its spec type.

Axis legend used in names and docstrings across the package:
T tokens (flat, packed), B sequences, H query heads, G kv heads, E head dim,
D hidden, F MLP intermediate, V vocabulary, N cache blocks, S block size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Union

import torch

from .attention import AttentionSpec
from .embedding import EmbeddingSpec, LMHeadSpec
from .errors import SpecError
from .mamba2 import Mamba2Spec
from .mlp import MLPSpec
from .moe import MoESpec
from .norm import RMSNormSpec
from .residual import PLAIN_RESIDUAL
from .weights import LinearFormat, linear_tensors

Mixer = Union[AttentionSpec, MLPSpec, Mamba2Spec, MoESpec]
"""The layer families of this package (each registered in ``layers.FAMILIES``). A
sublayer may hold any spec whose type has a registered family, also one defined
outside the package (``layers.register_family``)."""


@dataclass(frozen=True, kw_only=True)
class SublayerSpec:
    """One pre-norm sublayer of a block: ``mixer(norm(x))``, folded into the residual
    stream by the model's residual policy (:mod:`.residual`).

    ``index`` is the layer index of its block: the key of its state in the state
    store (together with the cache names its family declares) and of its HF names.
    """

    index: int
    norm: RMSNormSpec
    mixer: Any

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        return {**self.norm.parameter_shapes(), **self.mixer.parameter_shapes()}


@dataclass(frozen=True, kw_only=True)
class BlockSpec:
    """One layer: an ordered tuple of sublayers (Nemotron-H: one mixer; DeepSeek-V4:
    attention, then the FFN), each with its norm. How their outputs enter the
    residual stream is the model's :attr:`ModelSpec.residual` policy.

    Raises:
        SpecError: no sublayer, or a sublayer whose ``index`` is not the block's.
    """

    index: int
    sublayers: tuple[SublayerSpec, ...]

    def __post_init__(self) -> None:
        if not self.sublayers:
            raise SpecError(f"block {self.index} has no sublayer")
        for sub in self.sublayers:
            if sub.index != self.index:
                raise SpecError(f"block {self.index} holds a sublayer of layer {sub.index}")

    @staticmethod
    def single(index: int, norm: RMSNormSpec, mixer: Any) -> "BlockSpec":
        """A block of one pre-norm sublayer (``x + mixer(norm(x))`` under the plain policy)."""
        return BlockSpec(index=index, sublayers=(SublayerSpec(index=index, norm=norm, mixer=mixer),))

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for sub in self.sublayers:
            out.update(sub.parameter_shapes())
        return out


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A whole causal LM: embedding -> blocks of sublayers -> final norm -> LM head.

    ``residual`` is the residual-stream policy spec (default: one plain stream).

    ``weight_formats`` is the weight format of each quantized linear
    (:mod:`.weights`): ``(linear module name, LinearFormat)`` pairs, from the
    checkpoint's quantization config; every other linear is model-dtype. The
    sublayer specs declare their linears in the model dtype; the stored tensors
    of a quantized linear (:meth:`parameter_shapes`) come from its format.

    ``inert_parameters`` are ``(HF name, shape, stored dtype)`` of tensors the
    checkpoint carries that no forward reads (DeepSeek-V4's multi-token-prediction
    layer ``mtp.*``: rollout does no speculative decoding). Both engines allocate
    them; they are loaded, validated, saved and converted bit for bit like every
    parameter, and never trained (:meth:`untrained_parameter_names`).

    ``architecture`` is the name our vLLM plugin registers; ``hf_model_type``
    and ``hf_architecture`` say which transformers class is the peer.
    """

    family: str
    architecture: str
    hf_model_type: str
    hf_architecture: str
    embedding: EmbeddingSpec
    blocks: tuple[BlockSpec, ...]
    final_norm: RMSNormSpec
    lm_head: LMHeadSpec
    residual: Any = PLAIN_RESIDUAL
    dtype: torch.dtype = torch.bfloat16
    max_position_embeddings: int = 4096
    weight_formats: tuple[tuple[str, LinearFormat], ...] = ()
    inert_parameters: tuple[tuple[str, tuple[int, ...], torch.dtype], ...] = ()
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for i, block in enumerate(self.blocks):
            if block.index != i:
                raise SpecError(f"block {i} carries index {block.index}")
        check = getattr(self.residual, "validate_sublayers", None)  # mHC: one site per sublayer, in order
        if check is not None:
            check(self.sublayers)
        formats = dict(self.weight_formats)
        if len(formats) != len(self.weight_formats):
            raise SpecError("weight_formats names a linear twice")
        object.__setattr__(self, "_formats", formats)
        # every component is frozen: the tensor layout is computed (and checked: unknown
        # linears, K not a multiple of a format's block) once per spec
        object.__setattr__(self, "_layout", self._tensor_layout())

    def weight_format(self, linear: str) -> LinearFormat | None:
        """The format of the linear module ``linear`` (HF name without ``.weight``), or
        None for a model-dtype linear."""
        return self._formats.get(linear)

    def with_weight_formats(self, formats: dict[str, LinearFormat | None]) -> "ModelSpec":
        """A copy whose table has ``formats`` applied (None removes a linear's entry)."""
        table = dict(self._formats)
        for name, fmt in formats.items():
            if fmt is None:
                table.pop(name, None)
            else:
                table[name] = fmt
        return self.replace(weight_formats=tuple(table.items()))

    @property
    def stores_quantized_weights(self) -> bool:
        """True when some linear's checkpoint tensors are a format's codes and scales (not masters)."""
        return any(f.stored for f in self._formats.values())

    def _tensor_layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        """HF name -> (shape, stored dtype or None = component default), in model order."""
        declared: dict[str, tuple[int, ...]] = {}
        parts = [self.embedding, *self.blocks, self.residual, self.final_norm, self.lm_head]
        for part in parts:
            for name, shape in part.parameter_shapes().items():
                if name in declared:
                    raise SpecError(f"parameter {name} declared twice")
                declared[name] = shape
        linears = {n[: -len(".weight")]: n for n in declared if n.endswith(".weight")}
        for name in self._formats:
            if name not in linears or len(declared[linears[name]]) != 2:
                raise SpecError(f"weight_formats names {name!r}, which is not a linear of this model")
        out: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {}
        for name, shape in declared.items():
            fmt = self._formats.get(name[: -len(".weight")]) if name.endswith(".weight") else None
            if fmt is None:
                out[name] = (shape, None)
            else:
                out.update(linear_tensors(name[: -len(".weight")], fmt, shape[0], shape[1], self.dtype))
        for name, shape, dtype in self.inert_parameters:
            if name in out:
                raise SpecError(f"inert parameter {name} is also declared by a component")
            if not isinstance(dtype, torch.dtype) or any(not isinstance(d, int) or d < 0 for d in shape):
                raise SpecError(f"inert parameter {name}: shape {shape!r} / dtype {dtype!r} is not a shape of "
                                "ints >= 0 and a torch.dtype")
            out[name] = (tuple(shape), dtype)
        return out

    @property
    def vocab_size(self) -> int:
        return self.embedding.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.embedding.hidden_size

    @property
    def sublayers(self) -> tuple[SublayerSpec, ...]:
        """Every sublayer of every block, in forward order."""
        return tuple(sub for blk in self.blocks for sub in blk.sublayers)

    def sublayers_of(self, mixer_type: type) -> tuple[SublayerSpec, ...]:
        """The sublayers whose mixer is a ``mixer_type`` (subclasses included), in forward order.

        For tests and a family's own modules; engines iterate over the families'
        declarations (``unified_models.layers``) instead of switching on spec types.
        """
        return tuple(s for s in self.sublayers if isinstance(s.mixer, mixer_type))

    def map_mixers(self, fn) -> "ModelSpec":
        """A copy whose every sublayer's mixer is ``fn(mixer)`` (``fn`` returns it unchanged to keep it)."""
        return self.replace(blocks=tuple(
            dataclasses.replace(b, sublayers=tuple(dataclasses.replace(s, mixer=fn(s.mixer)) for s in b.sublayers))
            for b in self.blocks))

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """All parameters, HF name -> shape, in model order (a quantized linear's
        ``weight`` replaced by its format's tensors, :func:`.weights.linear_tensors`).

        Raises:
            SpecError: two components declare the same parameter name.
        """
        return {n: shape for n, (shape, _) in self._layout.items()}

    def parameter_dtypes(self) -> dict[str, torch.dtype]:
        """All parameters, HF name -> stored dtype: ``self.dtype`` unless a
        component's ``parameter_dtypes()`` (never trained: fp32 router bias, KV
        scales) or ``trainable_parameter_dtypes()`` (trained in their own dtype:
        fp32 mHC mixing weights) or a linear's weight format (codes, scales) says
        otherwise."""
        layout = self._layout
        out = {n: dt or self.dtype for n, (_, dt) in layout.items()}
        for part in self._declaring_parts():
            for method in ("parameter_dtypes", "trainable_parameter_dtypes"):
                declared = getattr(part, method, None)
                if declared is not None:
                    out.update(declared())
        return out

    def _declaring_parts(self) -> list[Any]:
        return [self.residual, *(p for sub in self.sublayers for p in (sub.norm, sub.mixer))]

    def untrained_parameter_names(self) -> set[str]:
        """Parameters that are never trained: what a component's ``parameter_dtypes()``
        stores in a dtype of its own (router correction bias, KV scales) and every tensor
        of a quantized linear except a master ``weight`` (codes, weight and input
        scales) and the :attr:`inert_parameters`. ``trainable_parameter_dtypes()`` entries
        are trained."""
        out = {n for n, (_, dt) in self._layout.items() if dt is not None}
        for name, fmt in self._formats.items():
            if not fmt.stored:
                out.discard(f"{name}.weight")
        for part in self._declaring_parts():
            declared = getattr(part, "parameter_dtypes", None)
            if declared is not None:
                out.update(declared())
            frozen = getattr(part, "untrained_parameter_names", None)  # model-dtype tensors never trained
            if frozen is not None:
                out.update(frozen())
        return out

    def replace(self, **changes) -> "ModelSpec":
        return dataclasses.replace(self, **changes)
