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
(DeepSeek-V4-Flash ``expert_dtype: fp4``; :mod:`unified_models.ops.mxfp4`) or block FP8
(Flash-Base ``expert_dtype: fp8``; :mod:`unified_models.ops.fp8_block.experts`), every routed
expert linear of a layer alike; the shared expert's three linears may be block FP8 (every published
block-FP8 checkpoint stores them so), all three alike; the router stays model-dtype.
:func:`.weight_formats.grouped_weight` turns the field stacks into the op's weight (stored codes,
or masters that the op quantizes on every forward, straight-through gradient); the shared expert
is the same kernel with one expert (:func:`.weight_formats.expert_linear_weight`). MXFP4 computes
W4A8, block FP8 W8A8 (per-token FP8 1x128 activation tiles in both). The oracle sees the masters
fake-quantized (the reference model's view) but does not model the FP8 activation rounding (as the
Mamba FP8 projections' oracle).

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
from .weight_formats import expert_linear_weight, grouped_weight, linear_fields

EXPERT_FORMATS = ("mxfp4", "fp8_block")
"""Weight formats the routed experts may carry (those with a grouped SwiGLU kernel)."""
SHARED_FORMATS = ("fp8_block",)
"""Weight formats the shared expert may carry (DeepSeek's published block-FP8 checkpoints)."""


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
    shared = [expert_linear_weight(ctx.model, params, spec.shared_linear(j))[0] for j in EXPERT_PROJS]
    shared_TD = ops.swiglu_shared_expert(x_TD, *shared, swiglu_limit=spec.swiglu_limit)
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


def deepseek_moe_near_ties(m: DeepseekV4MoESpec, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor,
                           engine_dtype: torch.dtype) -> torch.Tensor:
    """bool ``[T]``: the tokens whose top-k experts (``sqrt(softplus(x W^T)) + bias``,
    :func:`~unified_models.ops.moe.sqrtsoftplus_route_reference`) are decided by scores within the
    rounding of the engine's fp32 scores (:func:`.oracle.topk_near_ties`); none in a hash-routed layer
    (experts by token id)."""
    from .oracle import near_tie_margin, topk_near_ties

    del engine_dtype  # the engine's router scores are fp32 whatever the model dtype
    margin = near_tie_margin(torch.float32)
    if m.hash_routing:
        return torch.zeros(x_TD.shape[0], dtype=torch.bool, device=x_TD.device)
    s = torch.sqrt(torch.nn.functional.softplus(x_TD @ params[f"{m.name}.gate.weight"].to(x_TD.dtype).t()))
    return topk_near_ties(s + params[m.selection_name].to(x_TD.dtype), m.top_k, margin)


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


# ----------------------------------------------------------------------------- quantization (FP8 / MXFP4 experts)

def deepseek_moe_linears(m: DeepseekV4MoESpec) -> dict[str, str]:
    """Every routed expert's ``w1`` / ``w3`` / ``w2`` (export role ``"experts"``) and the shared expert's
    (role ``"shared_experts"``); the router is never quantized."""
    out = {m.expert_linear(e, proj): "experts" for e in range(m.n_routed_experts) for proj in EXPERT_PROJS}
    out.update({m.shared_linear(j): "shared_experts" for j in EXPERT_PROJS})
    return out


def deepseek_moe_check_formats(m: DeepseekV4MoESpec, weight_format) -> None:
    """Every routed expert linear of the layer in one format of :data:`EXPERT_FORMATS` (or none), the shared
    expert's three linears in one format of :data:`SHARED_FORMATS` (or none), the router model-dtype.

    Raises:
        SpecError: experts in different formats, a format without a grouped SwiGLU kernel, or a
            format on the router / shared expert (each names the layer or the linear).
    """
    fmts = {weight_format(m.expert_linear(e, proj)) for e in range(m.n_routed_experts) for proj in EXPERT_PROJS}
    if len(fmts) != 1:
        raise SpecError(f"{m.name}: routed experts in formats {sorted(str(f) for f in fmts)}; every routed expert "
                        "linear (w1, w3, w2) of a layer must have the same format (or none)")
    fmt = next(iter(fmts))
    if fmt is not None and fmt.format not in EXPERT_FORMATS:
        raise SpecError(f"{m.name}: routed experts in weight format {fmt.format!r}; DeepSeek-V4's SwiGLU experts "
                        f"kernels take model-dtype or {', '.join(map(repr, EXPERT_FORMATS))} weights")
    if weight_format(f"{m.name}.gate") is not None:
        raise SpecError(f"{m.name}.gate: a weight format on the router is not supported (its GEMM is the fp32 router)")
    shared = {j: weight_format(m.shared_linear(j)) for j in EXPERT_PROJS}
    if len(set(shared.values())) != 1:
        raise SpecError(f"{m.name}.shared_experts: w1/w3/w2 in formats "
                        f"{ {j: (f.format if f else None) for j, f in shared.items()} }; the three must have the same "
                        "format (or none)")
    sfmt = shared["w1"]
    if sfmt is not None and sfmt.format not in SHARED_FORMATS:
        raise SpecError(f"{m.name}.shared_experts: weight format {sfmt.format!r}; the shared expert takes "
                        f"model-dtype or {', '.join(map(repr, SHARED_FORMATS))} weights")


QUANTIZATION = QuantizationRules(linears=deepseek_moe_linears, check_formats=deepseek_moe_check_formats)

FAMILY = LayerFamily(spec_type=DeepseekV4MoESpec, forward=deepseek_moe_forward, oracle=deepseek_moe_oracle,
                     init_rules=deepseek_moe_init_rules, megatron_fields=deepseek_moe_megatron_fields,
                     stacked_parameters=deepseek_moe_stacked_parameters, frozen_views=deepseek_moe_frozen_views,
                     oracle_takes_input_ids=True, oracle_near_ties=deepseek_moe_near_ties, quantization=QUANTIZATION)
