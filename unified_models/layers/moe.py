"""Forward of :class:`~unified_models.dsl.MoESpec`: sigmoid router, relu2 experts, shared expert (stateless).

``ops.moe_route`` (fp32 router GEMM, total-order top-k) -> ``ops.moe_experts``
(grouped relu2 experts, fp32 combine in top-k slot order) with the shared
expert's fp32 output (``ops.moe_shared_expert``) added before the one rounding.

Expert weights: the checkpoint holds one tensor per expert
(``experts.{e}.up_proj.weight``); the ops take ``[E, N, K]`` stacks. An
engine may hand a ready stack (or an ``ops.NVFP4Weight`` loaded from a
ModelOpt checkpoint) under :meth:`MoESpec.stacked_expert_name`
(``<mixer>.experts.up_proj``); otherwise the per-expert tensors are viewed as
one stack without a copy when they are evenly spaced views of one buffer and
no gradient is needed, else stacked (``torch.stack``: gradients reach each
expert's parameter).

NVFP4 (``spec.quantization == "nvfp4"``): with ``checkpoint_format "master"``
the expert tensors are bf16 masters, quantized by ModelOpt's rule on every
forward inside ``ops.moe_experts`` (straight-through gradient); with
``"modelopt"`` the stored codes and scales are stacked (views when the engine
allocated them as one buffer, :mod:`unified_models.parameters`) into an
``ops.NVFP4Weight`` and used as they are.

Shapes: T tokens, D hidden, E experts, K top-k, I expert width.
"""

from __future__ import annotations

from typing import Mapping

import torch

from .. import ops
from ..dsl import MoESpec
from ..state import FlatBatch, StateStore
from .common import LayerContext


def _as_stack(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """``[E, N, K]`` view of equally shaped tensors that are evenly spaced views of one storage, or None."""
    t0 = ts[0]
    if len(ts) == 1:
        return t0[None]
    step = ts[1].storage_offset() - t0.storage_offset()
    if step <= 0:
        return None
    base = t0.untyped_storage().data_ptr()
    for j, t in enumerate(ts):
        if (t.shape != t0.shape or t.stride() != t0.stride() or t.dtype != t0.dtype
                or t.untyped_storage().data_ptr() != base or t.storage_offset() != t0.storage_offset() + j * step):
            return None
    return t0.as_strided((len(ts), *t0.shape), (step, *t0.stride()), t0.storage_offset())


def expert_weights(spec: MoESpec, params: Mapping[str, torch.Tensor], proj: str):
    """All routed experts' ``proj`` weight as one ``[E, N, K]`` tensor or ``ops.NVFP4Weight``.

    With gradients, the stack is a copy whose own version stamps would not see
    later writes to the experts' parameters, so the weight-version guard
    (DESIGN.md rule 11) is applied to each expert's parameter by a gradient
    hook on the stack: a backward after an in-place update raises
    ``ops.StaleWeightError`` naming an expert's weight (experts that are views
    of one buffer share its version counter: a write to any of them
    invalidates the whole stack).
    """
    stacked = params.get(spec.stacked_expert_name(proj))
    if stacked is not None:
        return stacked
    if spec.packed:  # ModelOpt NVFP4 as stored: codes and scales, no gradient
        fields = {}
        for field in spec.expert_proj_shapes(proj):
            ts = [params[spec.expert_tensor_names(e, proj)[field]] for e in range(spec.n_routed_experts)]
            view = _as_stack(ts)
            fields[field] = view if view is not None else torch.stack(ts)
        return ops.NVFP4Weight(fields["weight"], fields["weight_scale"], fields["weight_scale_2"],
                               fields.get("input_scale"))
    ts = [params[spec.expert_weight_name(e, proj)] for e in range(spec.n_routed_experts)]
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in ts)):
        view = _as_stack(ts)
        return view if view is not None else torch.stack(ts)
    from ..ops.grad.weights import check_stamps, stamp

    stamps = stamp(**{f"expert {e} {proj}": t for e, t in enumerate(ts)})
    out = torch.stack(ts)

    def guard(g):
        check_stamps("moe_experts", stamps)
        return g

    out.register_hook(guard)
    return out


def moe_forward(spec: MoESpec, layer_index: int, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor,
                batch: FlatBatch, store: StateStore, ctx: LayerContext) -> torch.Tensor:
    """``[T, D] -> [T, D]``: ``round(sum_k w_k expert_k(x) + shared(x))`` (fp32 sum in slot order)."""
    p = spec.name
    w_TK, ids_TK = ops.moe_route(x_TD, params[f"{p}.gate.weight"], params[f"{p}.gate.e_score_correction_bias"],
                                 **spec.route_kwargs())
    up, down = expert_weights(spec, params, "up_proj"), expert_weights(spec, params, "down_proj")
    nvfp4 = spec.quantization == "nvfp4"
    shared_TD = None
    if spec.shared_intermediate_size is not None:
        shared_TD = ops.moe_shared_expert(x_TD, params[f"{p}.shared_experts.up_proj.weight"],
                                          params[f"{p}.shared_experts.down_proj.weight"])
    return ops.moe_experts(x_TD, ids_TK, w_TK, up, down, shared_TD, nvfp4=nvfp4, out_dtype=x_TD.dtype)
