"""Token embedding and LM head specs (the two ends of the model)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class EmbeddingSpec:
    """Token embedding table ``weight [V, D]`` (HF name ``<prefix>.weight``)."""

    name: str
    vocab_size: int
    hidden_size: int

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        return {f"{self.name}.weight": (self.vocab_size, self.hidden_size)}


@dataclass(frozen=True, kw_only=True)
class LMHeadSpec:
    """Output projection ``weight [V, D]``; ``tied_to`` reuses the embedding table."""

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
