"""Layer families: each sublayer spec's forward over :mod:`unified_models.ops`, its
oracle and its declarations (:class:`~.family.LayerFamily`), and the residual policies.

One module per family (:mod:`.attention`, :mod:`.mlp`, :mod:`.mamba2`,
:mod:`.moe`), each ending in its ``FAMILY``, registered below, one line each
(registration order = the order Megatron fields merge). Every forward has the
signature of :data:`~.common.LayerFn`::

    fn(spec, layer_index, params, x_TD, batch, store, ctx) -> y_TD

Adding a family: a spec dataclass in ``dsl/``, a layer module here with its
forward, oracle and declarations, and one :func:`register_family` line (see
``docs/architecture.md``). Residual policies: :mod:`.residual`.

Shapes: T tokens, D hidden.
"""

from __future__ import annotations

from . import attention, deepseek_attention, deepseek_moe, mamba2, mlp, moe, qwen3_moe
from .common import LayerContext, LayerFn, bias_getter
from .family import (FAMILIES, LayerFamily, OracleFn, declares_slot_state, families_in_order, family_of, megatron_fields, model_caches,
                     register_family)
from .residual import PlainResidual, ResidualPolicy, register_residual, residual_policy

for _module in (attention, mlp, mamba2, moe, deepseek_moe, deepseek_attention, qwen3_moe):
    register_family(_module.FAMILY)

__all__ = ["FAMILIES", "LayerContext", "LayerFamily", "LayerFn", "OracleFn", "PlainResidual", "ResidualPolicy",
           "bias_getter", "declares_slot_state", "families_in_order", "family_of", "megatron_fields", "model_caches", "register_family",
           "register_residual", "residual_policy"]
