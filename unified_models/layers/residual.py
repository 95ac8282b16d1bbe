"""Residual-stream policies: how the forward carries the stream between sublayers.

:func:`unified_models.forward.forward_hidden` (and the reference model) hold an
opaque residual *state* and call, in order::

    r = policy.expand(rspec, params, h_TD)           # after the embedding
    for each sublayer:
        x_TD = policy.sublayer_input(rspec, params, r, sub)   # then its norm, its mixer
        r = policy.add(rspec, params, r, sub, y_TD)
    h_TD = policy.contract(rspec, params, r)          # before the final norm

``rspec`` is the model's ``ModelSpec.residual`` (a dataclass of :mod:`unified_models.dsl.residual`);
a policy is registered for its type with :func:`register_residual`, optionally with a
separate oracle (the reference model's fp32/fp64 form; default: the same object, valid
when the policy is plain elementwise torch that follows the dtype of its inputs).
Each method must keep rows independent (DESIGN rule 2) and round at fixed points.

Shapes: T tokens, D hidden.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

import torch

from ..dsl import PlainResidualSpec, SpecError


class ResidualPolicy(Protocol):
    """The four steps of a residual policy (see the module docstring)."""

    def expand(self, rspec: Any, params: Mapping[str, torch.Tensor], h_TD: torch.Tensor) -> Any: ...

    def sublayer_input(self, rspec: Any, params: Mapping[str, torch.Tensor], r: Any, sub: Any) -> torch.Tensor: ...

    def add(self, rspec: Any, params: Mapping[str, torch.Tensor], r: Any, sub: Any, y_TD: torch.Tensor) -> Any: ...

    def contract(self, rspec: Any, params: Mapping[str, torch.Tensor], r: Any) -> torch.Tensor: ...


class PlainResidual:
    """One stream in the model dtype: ``h = h + y`` (one IEEE rounding of the exact sum per
    sublayer, as transformers' ``NemotronHBlock``); the state is ``h_TD`` itself."""

    def expand(self, rspec, params, h_TD):
        return h_TD

    def sublayer_input(self, rspec, params, r, sub):
        return r

    def add(self, rspec, params, r, sub, y_TD):
        return r + y_TD

    def contract(self, rspec, params, r):
        return r


RESIDUALS: dict[type, tuple[ResidualPolicy, ResidualPolicy]] = {}
"""Residual spec type -> ``(engine policy, oracle policy)``."""


def register_residual(spec_type: type, policy: ResidualPolicy, oracle: ResidualPolicy | None = None) -> None:
    """Register the policy computing residual specs of ``spec_type`` (and its oracle)."""
    RESIDUALS[spec_type] = (policy, oracle if oracle is not None else policy)


def residual_policy(rspec: Any, *, oracle: bool = False) -> ResidualPolicy:
    """The engine (or, ``oracle=True``, the reference) policy of a residual spec.

    Raises:
        SpecError: no policy is registered for the spec's type (names it).
    """
    for cls in type(rspec).__mro__:
        hit = RESIDUALS.get(cls)
        if hit is not None:
            return hit[1] if oracle else hit[0]
    raise SpecError(f"no residual policy for {type(rspec).__name__} (known: "
                    f"{', '.join(sorted(c.__name__ for c in RESIDUALS))})")


register_residual(PlainResidualSpec, PlainResidual())
