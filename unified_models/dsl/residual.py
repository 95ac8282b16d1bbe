"""Residual-stream policy specs: how sublayer outputs enter the residual stream.

The forward (:func:`unified_models.forward.forward_hidden`) keeps an opaque
residual *state* and asks the model's policy, for each sublayer, for its input
(``pre``) and how its output folds back (``post``); ``expand`` builds the state
from the embedding and ``contract`` reduces it before the final norm. The
computation of each policy lives in :mod:`unified_models.layers.residual`
(registered by spec type, as the layer families are).

* :class:`PlainResidualSpec`: one stream in the model dtype, ``h = h + y``
  (one IEEE rounding of the exact sum per sublayer; Nemotron-H, Llama, ...).
* Hyper-connections with n streams (mHC, DeepSeek-V4: expand after the
  embedding, pre/post/Sinkhorn-residual mixing per sublayer, ``hc_head`` before
  the final norm) declare their own spec with their parameters here and their
  computation in ``layers/residual.py``; ``tests/test_family_protocol.py``
  defines a toy 2-stream policy through the same protocol.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class PlainResidualSpec:
    """One residual stream in the model dtype: ``h = h + mixer(norm(h))`` per sublayer. No parameters."""

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        return {}


PLAIN_RESIDUAL = PlainResidualSpec()
"""The default policy of :class:`~unified_models.dsl.ModelSpec`."""
