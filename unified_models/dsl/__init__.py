"""Spec dataclasses (frozen, keyword-only) and the errors for bad input."""

from .errors import (
    CheckpointError,
    ParallelismError,
    PromptError,
    SpecError,
    UnifiedModelsError,
    UnsupportedLayerError,
)
from .spec import (
    AttentionSpec,
    EmbeddingSpec,
    LMHeadSpec,
    MLPSpec,
    ModelSpec,
    ResidualBlockSpec,
    RMSNormSpec,
    RopeSpec,
)

__all__ = [
    "AttentionSpec", "EmbeddingSpec", "LMHeadSpec", "MLPSpec", "ModelSpec",
    "ResidualBlockSpec", "RMSNormSpec", "RopeSpec", "CheckpointError",
    "ParallelismError", "PromptError", "SpecError", "UnifiedModelsError",
    "UnsupportedLayerError",
]
