"""Residual-stream policies: how the forward carries the stream between sublayers.

:func:`unified_models.forward.forward_hidden` (and the reference model) hold an
opaque residual *state* and call, in order::

    r = policy.expand(rspec, params, h_TD)           # after the embedding
    for each sublayer:
        x_TD = policy.sublayer_input(rspec, params, r, sub)   # then its norm, its mixer
        r = policy.add(rspec, params, r, sub, y_TD)
    h_TD = policy.contract(rspec, params, r)          # before the final norm

A policy may also define ``add_and_norm(rspec, params, r, sub, y_TD, next_sub, weight_D, eps,
out_dtype) -> (r, x_TD)``: ``add``, then ``sublayer_input`` of ``next_sub`` (``contract`` when
``next_sub`` is None) and the RMSNorm of that input, in one step and bitwise equal to the
three, or None where it cannot; the forward calls it where present (taps off), and takes the
three steps where it is absent or returns None.
:class:`PlainResidual`'s is the fused add + RMSNorm kernel (``ops.add_rms_norm``).

``rspec`` is the model's ``ModelSpec.residual`` (a dataclass of :mod:`unified_models.dsl.residual`);
a policy is registered for its type with :func:`register_residual`, optionally with a
separate oracle (the reference model's fp32/fp64 form; default: the same object, valid
when the policy is plain elementwise torch that follows the dtype of its inputs).
Each method must keep rows independent (DESIGN rule 2) and round at fixed points.

Policies here: :class:`PlainResidual` (one stream) and :class:`HyperConnectionResidual`
(mHC, :class:`~unified_models.dsl.HyperConnectionSpec`; the math is :mod:`unified_models.ops.mhc`,
the oracle the same class over the ops' fp64 references).

Shapes: T tokens, D hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import torch

from .. import ops
from ..dsl import HyperConnectionSpec, PlainResidualSpec, SpecError
from ..ops.mhc import hc_head_reference, hc_post_reference, hc_pre_reference


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

    def add_and_norm(self, rspec, params, r, sub, y_TD, next_sub, weight_D, eps, out_dtype):
        """``r + y_TD`` and its RMSNorm in one kernel (``ops.add_rms_norm``; bitwise ``add`` then
        ``ops.rms_norm``): ``(r, x_TD)``, the stream ``[T, D]`` and the next norm's output. None (the
        forward takes the steps) for a subclass that overrides ``add``, ``sublayer_input`` or
        ``contract``, or an update of another dtype than the stream's."""
        cls = type(self)
        own = (cls.add is PlainResidual.add and cls.sublayer_input is PlainResidual.sublayer_input
               and cls.contract is PlainResidual.contract)
        if not own or r.dtype != y_TD.dtype:  # the kernel adds two tensors of the stream's dtype
            return None
        return ops.add_rms_norm(r, y_TD, weight_D, eps, out_dtype=out_dtype)


@dataclass
class HCState:
    """mHC residual state: the streams ``[T, n, D]`` and, between a sublayer's
    ``sublayer_input`` and its ``add``, the ``(post, comb)`` its HC pre computed (by HC name)."""

    streams: torch.Tensor
    pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class HyperConnectionResidual:
    """mHC over :mod:`unified_models.ops.mhc`; ``pre`` / ``post`` / ``head`` are the engine's
    differentiable ops (default) or the fp64 oracle's. ``expand`` copies the embedding into n
    streams (``DeepseekV4Model.forward``), ``sublayer_input`` is the sublayer's HC pre, ``add``
    its HC post, ``contract`` ``hc_head``; the state is an :class:`HCState`.

    Raises:
        SpecError: a sublayer has no site in the spec (``HyperConnectionSpec.site``).
        RuntimeError: ``add`` of a sublayer whose ``sublayer_input`` was not called first.
    """

    def __init__(self, pre: Callable = ops.hc_pre, post: Callable = ops.hc_post, head: Callable = ops.hc_head):
        self.pre, self.post, self.head = pre, post, head

    def expand(self, rspec, params, h_TD):
        return HCState(h_TD.unsqueeze(1).expand(-1, rspec.hc_mult, -1).contiguous())

    def sublayer_input(self, rspec, params, r, sub):
        p = rspec.site(sub)
        x_TD, post, comb = self.pre(r.streams, params[p + "_fn"], params[p + "_base"], params[p + "_scale"],
                                    norm_eps=rspec.norm_eps, hc_eps=rspec.hc_eps, sinkhorn_iters=rspec.sinkhorn_iters)
        r.pending[p] = (post, comb)
        return x_TD

    def add(self, rspec, params, r, sub, y_TD):
        p = rspec.site(sub)
        if p not in r.pending:
            raise RuntimeError(f"mHC: add() of sublayer {p!r} without its sublayer_input() first")
        post, comb = r.pending.pop(p)
        return HCState(self.post(r.streams, y_TD.to(r.streams.dtype), post, comb))

    @staticmethod
    def init_rules(rspec) -> dict[str, Callable[[torch.Tensor], Any]]:
        """transformers' ``DeepseekV4PreTrainedModel._init_weights`` for the non-generic ones:
        ``base`` / ``hc_base`` 0, ``scale`` / ``hc_scale`` 1 (``fn`` / ``hc_fn``: the generic normal)."""
        rules: dict[str, Callable[[torch.Tensor], Any]] = {}
        for name in rspec.parameter_shapes():
            if name.endswith("base"):
                rules[name] = lambda p: p.zero_()
            elif name.endswith("scale"):
                rules[name] = lambda p: p.fill_(1.0)
        return rules

    def contract(self, rspec, params, r):
        h = rspec.head_name
        return self.head(r.streams, params[h + ".hc_fn"], params[h + ".hc_base"], params[h + ".hc_scale"],
                         norm_eps=rspec.norm_eps, hc_eps=rspec.hc_eps)


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
register_residual(HyperConnectionSpec, HyperConnectionResidual(),
                  oracle=HyperConnectionResidual(hc_pre_reference, hc_post_reference, hc_head_reference))
