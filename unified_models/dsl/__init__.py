"""Spec dataclasses (frozen, keyword-only) and the errors for bad input.

A spec says *what* a model computes (layer types, widths, which activation,
which parameters exist and under which Hugging Face names); the kernels that
compute it live in :mod:`unified_models.ops`, each layer family's forward over
those kernels in :mod:`unified_models.layers`, and the engine adapters in
:mod:`unified_models.backends`. Every engine builds its parameters from
:meth:`ModelSpec.parameter_shapes`, so the backends can never disagree on
names or shapes.

One module per family: :mod:`.attention` (``AttentionSpec``, ``RopeSpec``),
:mod:`.mlp` (``MLPSpec``), :mod:`.mamba2` (``Mamba2Spec``), :mod:`.moe`
(``MoESpec``), :mod:`.norm` (``RMSNormSpec``), :mod:`.embedding`
(``EmbeddingSpec``, ``LMHeadSpec``), :mod:`.model` (``BlockSpec``, ``SublayerSpec``,
``ModelSpec``, the ``Mixer`` union), :mod:`.residual` (residual-stream
policies), :mod:`.weights` (``LinearFormat``: the weight format of a quantized
linear, ``ModelSpec.weight_formats``); :mod:`.errors`.

Axis legend used in names and docstrings across the package:
T tokens (flat, packed), B sequences, H query heads, G kv heads, E head dim,
D hidden, F MLP intermediate, V vocabulary, N cache blocks, S block size.
"""

from .attention import AttentionSpec, RopeSpec
from .deepseek_attention import DeepseekV4AttentionSpec, YarnRope
from .embedding import EmbeddingSpec, LMHeadSpec
from .errors import (
    CheckpointError,
    ParallelismError,
    PromptError,
    SpecError,
    UnifiedModelsError,
    UnsupportedLayerError,
)
from .mamba2 import Mamba2Spec
from .mlp import MLPSpec
from .moe import MoESpec
from .deepseek_moe import DeepseekV4MoESpec
from .qwen3_moe import Qwen3MoESpec
from .model import BlockSpec, Mixer, ModelSpec, SublayerSpec
from .residual import PLAIN_RESIDUAL, HyperConnectionSpec, PlainResidualSpec
from .norm import RMSNormSpec
from .weights import LinearFormat

__all__ = [
    "AttentionSpec", "EmbeddingSpec", "LMHeadSpec", "MLPSpec", "ModelSpec",
    "BlockSpec", "SublayerSpec", "PlainResidualSpec", "HyperConnectionSpec", "PLAIN_RESIDUAL", "RMSNormSpec", "RopeSpec", "CheckpointError",
    "ParallelismError", "PromptError", "SpecError", "UnifiedModelsError",
    "UnsupportedLayerError", "Mixer", "Mamba2Spec", "MoESpec", "LinearFormat", "DeepseekV4MoESpec",
    "DeepseekV4AttentionSpec", "Qwen3MoESpec",
    "YarnRope",
]
