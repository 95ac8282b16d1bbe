"""What every layer function shares: its signature and the model-wide context.

A layer function computes one residual block's mixer over the flat batch::

    fn(spec, layer_index, params, x_TD, batch, store, ctx) -> y_TD

* ``spec``: the block's mixer spec (its type picks ``fn`` in ``layers.LAYERS``);
* ``layer_index``: the block's index (``ResidualBlockSpec.index``), the key of
  its state in ``store``;
* ``params``: HF parameter name -> tensor (``ModelSpec.dtype``), the whole model's;
* ``x_TD``: ``[T, D]`` normed input of the block;
* ``batch``: the :class:`~unified_models.state.FlatBatch`;
* ``store``: the :class:`~unified_models.state.StateStore`; stateless layers ignore it;
* ``ctx``: :class:`LayerContext`, model-wide facts.

Returns ``[T, D]`` in ``ModelSpec.dtype``; the forward adds it to the residual.
Layer functions call only :mod:`unified_models.ops` (never an engine) and
must keep each token's row independent of its neighbours (DESIGN rule 2).

Shapes: T tokens, D hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from ..state import FlatBatch, StateStore
from .expert_parallel import LOCAL_EXPERTS, ExpertDispatcher, ShardPlan

if TYPE_CHECKING:  # pragma: no cover
    from ..dsl import ModelSpec


@dataclass(frozen=True)
class LayerContext:
    """Model-wide facts a layer may need (never per-layer weights or state).

    Attributes:
        model: the whole model spec (``max_position_embeddings``, ``dtype``, ...).
        cache: per-forward memo of batch-wide derived data shared by layers of
            one family (e.g. the Mamba-2 batch metadata, built once per forward
            for every Mamba layer); one fresh context per forward.
        shard_plan: how the routed experts are sharded over expert parallelism
            (:class:`~.expert_parallel.ShardPlan`; default EP = 1).
        dispatcher: runs the routed experts (:class:`~.expert_parallel.ExpertDispatcher`;
            default :class:`~.expert_parallel.LocalExperts`, every expert here).
    """

    model: "ModelSpec"
    cache: dict = field(default_factory=dict, compare=False, repr=False)
    shard_plan: ShardPlan = field(default_factory=ShardPlan)
    dispatcher: ExpertDispatcher = LOCAL_EXPERTS

    @property
    def max_positions(self) -> int:
        """Rows of position-indexed tables (RoPE): ``model.max_position_embeddings``."""
        return self.model.max_position_embeddings


LayerFn = Callable[[Any, int, Mapping[str, torch.Tensor], torch.Tensor, FlatBatch, StateStore, LayerContext],
                   torch.Tensor]
"""``(spec, layer_index, params, x_TD, batch, store, ctx) -> y_TD``."""


def bias_getter(prefix: str, params: Mapping[str, torch.Tensor], has_bias: bool
                ) -> Callable[[str], torch.Tensor | None]:
    """``bias("q_proj")`` -> ``params[f"{prefix}.q_proj.bias"]`` if the spec has biases, else ``None``."""
    if has_bias:
        return lambda n: params[f"{prefix}.{n}.bias"]
    return lambda n: None
