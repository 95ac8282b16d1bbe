"""Forward of :class:`~unified_models.dsl.MLPSpec`: dense relu2 or SwiGLU MLP (stateless).

Shapes: T tokens, D hidden, F intermediate.
"""

from __future__ import annotations

from typing import Mapping

import torch

from .. import ops
from ..dsl import MLPSpec
from ..state import FlatBatch, StateStore
from .common import LayerContext, bias_getter


def mlp_forward(spec: MLPSpec, layer_index: int, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor,
                batch: FlatBatch, store: StateStore, ctx: LayerContext) -> torch.Tensor:
    """``down(act(...))``: ``[T, D] -> [T, F] -> [T, D]``; SwiGLU rounds once after ``silu(gate) * up``."""
    p = spec.name
    bias = bias_getter(p, params, spec.bias)
    up_TF = ops.linear(x_TD, params[f"{p}.up_proj.weight"], bias("up_proj"))
    if spec.activation == "relu2":
        act_TF = ops.relu2(up_TF)
    else:
        act_TF = ops.swiglu(ops.linear(x_TD, params[f"{p}.gate_proj.weight"], bias("gate_proj")), up_TF)
    return ops.linear(act_TF, params[f"{p}.down_proj.weight"], bias("down_proj"))
