"""Forward of :class:`~unified_models.dsl.DeepseekV4MoESpec`: sqrt-softplus (or hash) router,
clamped-SwiGLU routed experts, shared expert (stateless).

``ops.sqrtsoftplus_route`` / ``ops.hash_route`` (one fp32 router GEMM; total-order top-k, or
``tid2eid[batch.input_ids]``) -> ``ctx.dispatcher.swiglu_experts`` (routed experts, routing weight
applied before the down projection, fp32 combine in slot order) with the shared expert's fp32
output (``ops.swiglu_shared_expert``) added before the one rounding. Math and names:
transformers 5.19 ``DeepseekV4SparseMoeBlock`` (package doc of :mod:`unified_models.ops.moe.deepseek`).

Expert weights: one tensor per expert and projection in the checkpoint (``experts.{e}.w1``, ``w3``,
``w2``); stacked to ``[E, N, K]`` as the Nemotron-H MoE does (:func:`.moe.expert_weights`: a view
when they are evenly spaced views of one buffer, which :func:`stacked_parameters` makes them,
else ``torch.stack`` with the weight-version guard).

Weight formats (:data:`QUANTIZATION`): the routed experts' ``w1``/``w3``/``w2`` may be MXFP4
(DeepSeek-V4-Flash ``expert_dtype: fp4``; :mod:`unified_models.ops.mxfp4`), every routed expert
linear of a layer alike; the router and the shared expert stay model-dtype, and any other format
(e.g. block-FP8 experts, ``expert_dtype: fp8``) is refused naming the layer, as it has no grouped
SwiGLU kernel. :func:`.weight_formats.grouped_weight` turns the field stacks into the op's weight:
an ``ops.mxfp4.MXFP4Weight`` of stored codes, or an ``MXFP4Master`` of masters that the op
quantizes on every forward (straight-through gradient). Both compute W4A8 (per-token FP8 1x128
activation tiles). The oracle sees the masters fake-quantized (the reference model's view) but
does not model the FP8 activation rounding (as the Mamba FP8 projections' oracle).

Shapes: T tokens, D hidden, E experts, K top-k, I expert width.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .. import ops
from ..dsl import DeepseekV4MoESpec, ParallelismError, SpecError
from ..dsl.deepseek_moe import EXPERT_PROJS
from ..ops.moe import (hash_route_reference, sqrtsoftplus_route_reference, swiglu_experts_reference,
                       swiglu_shared_expert_reference)
from ..state import FlatBatch, StateStore
from .common import LayerContext
from .family import LayerFamily
from .moe import _as_stack, expert_stack_key, expert_weights
from .quantization import QuantizationRules
from .weight_formats import grouped_weight, linear_fields

EXPERT_FORMATS = ("mxfp4",)
"""Weight formats the routed experts may carry (those with a grouped SwiGLU kernel)."""


def _route(spec: DeepseekV4MoESpec, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor,
           input_ids_T: torch.Tensor | None):
    gate = params[f"{spec.name}.gate.weight"]
    sel = params[spec.selection_name]
    if spec.hash_routing:
        return ops.hash_route(x_TD, gate, sel, input_ids_T, **spec.route_kwargs())
    return ops.sqrtsoftplus_route(x_TD, gate, sel, top_k=spec.top_k, **spec.route_kwargs())


def deepseek_moe_forward(spec: DeepseekV4MoESpec, layer_index: int, params: Mapping[str, torch.Tensor],
                         x_TD: torch.Tensor, batch: FlatBatch, store: StateStore, ctx: LayerContext) -> torch.Tensor:
    """``[T, D] -> [T, D]``: ``round(sum_k w2_e(w_k swiglu_e(x)) + shared(x))`` (fp32 sum in slot order).

    A hash layer takes its tokens' ids from ``batch.input_ids``.

    Raises:
        ParallelismError: ``ctx.dispatcher`` has no ``swiglu_experts`` (an expert-parallel dispatcher
            written for the relu2 experts only).
    """
    w_TK, ids_TK = _route(spec, params, x_TD, batch.input_ids)
    stacks = []
    for proj in EXPERT_PROJS:
        weight, kind = expert_weights(spec, ctx.model, params, proj)
        if kind is not None and kind not in EXPERT_FORMATS:  # pragma: no cover - refused by check_weight_formats
            raise SpecError(f"{spec.name}.experts.*.{proj}: weight format {kind!r} has no SwiGLU expert kernel")
        stacks.append(weight)
    shared_TD = ops.swiglu_shared_expert(x_TD, *(params[f"{spec.shared_linear(j)}.weight"] for j in EXPERT_PROJS),
                                         swiglu_limit=spec.swiglu_limit)
    run = getattr(ctx.dispatcher, "swiglu_experts", None)
    if run is None:
        raise ParallelismError(f"{spec.name}: the expert dispatcher {type(ctx.dispatcher).__name__} has no "
                               "swiglu_experts (DeepSeek-V4's SwiGLU experts; layers/expert_parallel.py)")
    return run(ctx.shard_plan, x_TD, ids_TK, w_TK, *stacks, shared_TD, swiglu_limit=spec.swiglu_limit,
               out_dtype=x_TD.dtype)


def deepseek_moe_oracle(m: DeepseekV4MoESpec, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor,
                        input_ids_T: torch.Tensor | None = None) -> torch.Tensor:
    """Router, experts and shared expert with the ops' fp64 oracles, in ``x_TD.dtype``.

    Raises:
        SpecError: a hash-routed layer without ``input_ids_T`` (its experts are chosen by token id).
    """
    if m.hash_routing and input_ids_T is None:
        raise SpecError(f"{m.name}: the oracle of a hash-routed DeepSeek-V4 MoE needs the token ids "
                        "(input_ids_T=...)")
    gate, sel = params[f"{m.name}.gate.weight"], params[m.selection_name]
    if m.hash_routing:
        wts, ids = hash_route_reference(x_TD, gate, sel, input_ids_T, **m.route_kwargs())
    else:
        wts, ids = sqrtsoftplus_route_reference(x_TD, gate, sel, top_k=m.top_k, **m.route_kwargs())
    shared = swiglu_shared_expert_reference(x_TD, *(params[f"{m.shared_linear(j)}.weight"] for j in EXPERT_PROJS),
                                            swiglu_limit=m.swiglu_limit)
    stacks = [torch.stack([params[f"{m.expert_linear(e, j)}.weight"] for e in range(m.n_routed_experts)])
              for j in EXPERT_PROJS]
    return swiglu_experts_reference(x_TD, ids, wts, *stacks, shared, swiglu_limit=m.swiglu_limit).to(x_TD.dtype)


def deepseek_moe_frozen_views(spec: DeepseekV4MoESpec, model, params: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The routed experts' ``(weight, kind)`` per projection when every stacked field is a view of one
    buffer (as :func:`.moe.moe_frozen_views`, over ``w1``/``w3``/``w2``; MXFP4 codes and scales alike)."""
    out: dict[str, Any] = {}
    for proj in EXPERT_PROJS:
        linears = [spec.expert_linear(e, proj) for e in range(spec.n_routed_experts)]
        stacks = {f: _as_stack([params[f"{n}.{f}"] for n in linears])
                  for f in linear_fields(model.weight_format(linears[0]))}
        if all(v is not None for v in stacks.values()):
            out[expert_stack_key(spec, proj)] = grouped_weight(model, stacks, linears)
    return out


def deepseek_moe_init_rules(m: DeepseekV4MoESpec) -> dict:
    """The selection bias starts at 0, the hash table at 0 (transformers ``_init_weights``; its real
    values come from a checkpoint)."""
    return {m.selection_name: lambda p: p.zero_()}


def deepseek_moe_megatron_fields(m: DeepseekV4MoESpec) -> dict:
    """Megatron's MoE sizes (its router has no sqrt-softplus scoring; our forward routes)."""
    i = m.moe_intermediate_size
    return dict(ffn_hidden_size=i, num_moe_experts=m.n_routed_experts, moe_router_topk=m.top_k,
                moe_ffn_hidden_size=i, moe_shared_expert_intermediate_size=i * m.n_shared_experts,
                moe_router_topk_scaling_factor=m.routed_scaling_factor)


def deepseek_moe_stacked_parameters(m: DeepseekV4MoESpec) -> tuple[tuple[str, ...], ...]:
    """One group per projection (``w1``, ``w3``, ``w2``): the routed experts', expert 0 first."""
    return tuple(tuple(m.expert_linear(e, proj) for e in range(m.n_routed_experts)) for proj in EXPERT_PROJS)


# ----------------------------------------------------------------------------- quantization (MXFP4 experts)

def deepseek_moe_linears(m: DeepseekV4MoESpec) -> dict[str, str]:
    """Every routed expert's ``w1`` / ``w3`` / ``w2``: export role ``"experts"`` (the router and the
    shared expert are never quantized)."""
    return {m.expert_linear(e, proj): "experts" for e in range(m.n_routed_experts) for proj in EXPERT_PROJS}


def deepseek_moe_check_formats(m: DeepseekV4MoESpec, weight_format) -> None:
    """Every routed expert linear of the layer in one format of :data:`EXPERT_FORMATS` (MXFP4), or none;
    the router and the shared expert model-dtype.

    Raises:
        SpecError: experts in different formats, a format without a grouped SwiGLU kernel, or a
            format on the router / shared expert (each names the layer or the linear).
    """
    fmts = {weight_format(n) for n in deepseek_moe_linears(m)}
    if len(fmts) != 1:
        raise SpecError(f"{m.name}: routed experts in formats {sorted(str(f) for f in fmts)}; every routed expert "
                        "linear (w1, w3, w2) of a layer must have the same format (or none)")
    fmt = next(iter(fmts))
    if fmt is not None and fmt.format not in EXPERT_FORMATS:
        raise SpecError(f"{m.name}: routed experts in weight format {fmt.format!r}; DeepSeek-V4's SwiGLU experts "
                        f"kernels take model-dtype or {', '.join(map(repr, EXPERT_FORMATS))} weights")
    shared = [m.shared_linear(j) for j in EXPERT_PROJS]
    for n in (f"{m.name}.gate", *shared):
        if weight_format(n) is not None:
            raise SpecError(f"{n}: a weight format on the router or the shared expert is not supported "
                            "(only the routed experts may be MXFP4)")


QUANTIZATION = QuantizationRules(linears=deepseek_moe_linears, check_formats=deepseek_moe_check_formats)

FAMILY = LayerFamily(spec_type=DeepseekV4MoESpec, forward=deepseek_moe_forward, oracle=deepseek_moe_oracle,
                     init_rules=deepseek_moe_init_rules, megatron_fields=deepseek_moe_megatron_fields,
                     stacked_parameters=deepseek_moe_stacked_parameters, frozen_views=deepseek_moe_frozen_views,
                     oracle_takes_input_ids=True, quantization=QUANTIZATION)
