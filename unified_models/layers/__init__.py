"""Layer families: each mixer spec's forward over :mod:`unified_models.ops`.

One module per family (:mod:`.attention`, :mod:`.mlp`, :mod:`.mamba2`,
:mod:`.moe`; next ``dsv4_attention``) and **one table**, :data:`LAYERS`, from spec
type to layer function; :func:`unified_models.forward.forward_hidden` looks
each block's function up here. Every function has the signature of
:data:`~.common.LayerFn`::

    fn(spec, layer_index, params, x_TD, batch, store, ctx) -> y_TD

Adding a family: a spec module in ``dsl/`` (added to ``dsl.model.Mixer``),
a layer module here, and one line in :data:`LAYERS`. Mamba-2
(:mod:`.mamba2`) reads its per-request state slots through
``store.mamba_state(layer_index)`` (see :mod:`unified_models.state`); MoE
(:mod:`.moe`) is stateless like the MLP.

Shapes: T tokens, D hidden.
"""

from __future__ import annotations

from typing import Any

from ..dsl import AttentionSpec, Mamba2Spec, MLPSpec, MoESpec, SpecError
from .attention import attention_forward
from .common import LayerContext, LayerFn, bias_getter
from .mamba2 import mamba2_forward
from .mlp import mlp_forward
from .moe import moe_forward

LAYERS: dict[type, LayerFn] = {
    AttentionSpec: attention_forward,
    MLPSpec: mlp_forward,
    Mamba2Spec: mamba2_forward,
    MoESpec: moe_forward,
}
"""Spec type -> layer function. The only place a spec type meets its forward."""


def layer_function(spec: Any, layer_index: int) -> LayerFn:
    """The layer function of ``spec`` (looked up by its type, then its base classes).

    Raises:
        SpecError: no layer function for this spec type; names the type and
            the layer index.
    """
    for cls in type(spec).__mro__:
        fn = LAYERS.get(cls)
        if fn is not None:
            return fn
    known = ", ".join(sorted(c.__name__ for c in LAYERS))
    raise SpecError(f"layer {layer_index}: no layer function for spec type {type(spec).__name__} "
                    f"(known: {known})")


__all__ = ["LAYERS", "LayerContext", "LayerFn", "attention_forward", "bias_getter", "layer_function",
           "mamba2_forward", "mlp_forward", "moe_forward"]
