"""Forward of :class:`~unified_models.dsl.MLPSpec`: dense relu2 or SwiGLU MLP (stateless).

Shapes: T tokens, D hidden, F intermediate.
"""

from __future__ import annotations

from typing import Mapping

import torch

from .. import ops
from ..dsl import MLPSpec
from ..porting import taps
from ..state import FlatBatch, StateStore
from .common import LayerContext, bias_getter
from .family import LayerFamily
from .oracle import linear_oracle


def mlp_forward(spec: MLPSpec, layer_index: int, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor,
                batch: FlatBatch, store: StateStore, ctx: LayerContext) -> torch.Tensor:
    """``down(act(...))``: ``[T, D] -> [T, F] -> [T, D]``; SwiGLU rounds once after ``silu(gate) * up``."""
    p = spec.name
    bias = bias_getter(p, params, spec.bias)
    up_TF = ops.linear(x_TD, params[f"{p}.up_proj.weight"], bias("up_proj"))
    if taps.SINK is not None: up_TF = taps.SINK(f"{p}.up_proj", up_TF)
    if spec.activation == "relu2":
        act_TF = ops.relu2(up_TF)
    else:
        gate_TF = ops.linear(x_TD, params[f"{p}.gate_proj.weight"], bias("gate_proj"))
        if taps.SINK is not None: gate_TF = taps.SINK(f"{p}.gate_proj", gate_TF)
        act_TF = ops.swiglu(gate_TF, up_TF)
    if taps.SINK is not None: act_TF = taps.SINK(f"{p}.act", act_TF)
    y_TD = ops.linear(act_TF, params[f"{p}.down_proj.weight"], bias("down_proj"))
    if taps.SINK is not None: y_TD = taps.SINK(f"{p}.down_proj", y_TD)
    return y_TD


def mlp_oracle(m: MLPSpec, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor) -> torch.Tensor:
    """``down(act(...))`` in ``x_TD.dtype``, no intermediate rounding."""
    up = linear_oracle(x_TD, params, m.name + ".up_proj", m.bias)
    if m.activation == "relu2":
        act = torch.relu(up).pow(2)
    else:
        act = torch.nn.functional.silu(linear_oracle(x_TD, params, m.name + ".gate_proj", m.bias)) * up
    return linear_oracle(act, params, m.name + ".down_proj", m.bias)


def mlp_megatron_fields(m: MLPSpec) -> dict:
    """Megatron's MLP sizes: ``ffn_hidden_size`` and bias."""
    return dict(ffn_hidden_size=m.intermediate_size, add_bias_linear=m.bias)


FAMILY = LayerFamily(spec_type=MLPSpec, forward=mlp_forward, oracle=mlp_oracle, megatron_fields=mlp_megatron_fields)
