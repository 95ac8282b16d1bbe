"""Dense MLP specs.

Forward: :mod:`unified_models.layers.mlp`. Stateless.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .errors import SpecError

Activation = Literal["relu2", "swiglu"]


@dataclass(frozen=True, kw_only=True)
class MLPSpec:
    """Dense MLP.

    ``relu2``: ``down(relu(up(x))^2)`` (Nemotron-H, ``mlp_hidden_act="relu2"``).
    ``swiglu``: ``down(silu(gate(x)) * up(x))`` (Llama/DeepSeek).
    ``up_proj``/``gate_proj [F, D]``, ``down_proj [D, F]``.
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
