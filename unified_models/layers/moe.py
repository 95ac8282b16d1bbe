"""Forward of :class:`~unified_models.dsl.MoESpec`: sigmoid router, relu2 experts, shared expert (stateless).

``ops.moe_route`` (fp32 router GEMM, total-order top-k) -> ``ops.moe_experts``
(grouped relu2 experts, fp32 combine in top-k slot order) with the shared
expert's fp32 output (``ops.moe_shared_expert``) added before the one rounding.

Expert weights: the checkpoint holds one tensor per expert
(``experts.{e}.up_proj.weight``); the ops take ``[E, N, K]`` stacks. The
per-expert tensors are viewed as one stack without a copy when they are evenly
spaced views of one buffer (:mod:`unified_models.parameters` allocates them so)
and no gradient is needed, else stacked (``torch.stack``: gradients reach each
expert's parameter).

Weight formats (``ModelSpec.weight_formats``, all experts of a projection
alike): the field stacks become the op's weight through
:func:`.weight_formats.grouped_weight`. NVFP4 masters are quantized by
ModelOpt's rule on every forward inside ``ops.moe_experts`` (straight-through
gradient); NVFP4 as stored is an ``ops.NVFP4Weight`` of the codes and scales.

Shapes: T tokens, D hidden, E experts, K top-k, I expert width.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .. import ops
from ..dsl import MoESpec, SpecError
from ..ops.moe import moe_experts_reference, moe_route_reference, moe_shared_expert_reference
from ..porting import taps
from ..state import FlatBatch, StateStore
from .common import LayerContext
from .family import LayerFamily
from .quantization import QuantizationRules
from .weight_formats import grouped_weight, linear_fields


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


def _stack(ts: list[torch.Tensor]) -> torch.Tensor:
    view = _as_stack(ts)
    return view if view is not None else torch.stack(ts)


def expert_stack_key(spec: MoESpec, proj: str) -> str:
    """Key of a ready-made ``(weight, kind)`` of all experts' ``proj`` in the forward's params
    (:func:`moe_frozen_views`): transformers' in-memory name ``<mixer>.experts.<proj>``,
    never a checkpoint tensor."""
    return f"{spec.name}.experts.{proj}"


def moe_frozen_views(spec: MoESpec, model, params: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The routed experts' ``(weight, kind)`` per projection when every stacked field is a
    view of one buffer (:func:`_as_stack`; vLLM allocates them so), for an engine to build
    once instead of per forward. Projections whose tensors are not views are left out (a
    copied stack would go stale after an in-place weight update)."""
    return expert_frozen_views(spec, model, params, ("up_proj", "down_proj"))


def expert_frozen_views(spec: Any, model, params: Mapping[str, torch.Tensor], projs: tuple[str, ...]) -> dict[str, Any]:
    """:func:`moe_frozen_views` for any MoE spec with ``n_routed_experts`` and ``expert_linear(e, proj)``,
    over the projections ``projs``."""
    out: dict[str, Any] = {}
    for proj in projs:
        linears = [spec.expert_linear(e, proj) for e in range(spec.n_routed_experts)]
        stacks = {f: _as_stack([params[f"{n}.{f}"] for n in linears])
                  for f in linear_fields(model.weight_format(linears[0]))}
        if all(v is not None for v in stacks.values()):
            out[expert_stack_key(spec, proj)] = grouped_weight(model, stacks, linears)
    return out


def expert_weights(spec: MoESpec, model, params: Mapping[str, torch.Tensor], proj: str) -> tuple[Any, str | None]:
    """All routed experts' ``proj`` weight for ``ops.moe_experts``: ``(weight, kind)`` of
    :func:`.weight_formats.grouped_weight` (an ``[E, N, K]`` tensor or ``ops.NVFP4Weight``).

    With gradients, the stack is a copy whose own version stamps would not see
    later writes to the experts' parameters, so the weight-version guard
    (DESIGN.md rule 11) is applied to each expert's parameter by a gradient
    hook on the stack: a backward after an in-place update raises
    ``ops.StaleWeightError`` naming an expert's weight (experts that are views
    of one buffer share its version counter: a write to any of them
    invalidates the whole stack).
    """
    ready = params.get(expert_stack_key(spec, proj))
    if ready is not None:
        return ready
    linears = [spec.expert_linear(e, proj) for e in range(spec.n_routed_experts)]
    stacks: dict[str, torch.Tensor] = {}
    for field in linear_fields(model.weight_format(linears[0])):
        ts = [params[f"{n}.{field}"] for n in linears]
        if field != "weight" or not (torch.is_grad_enabled() and any(t.requires_grad for t in ts)):
            stacks[field] = _stack(ts)
            continue
        from ..ops.grad.weights import check_stamps, stamp

        stamps = stamp(**{f"expert {e} {proj}": t for e, t in enumerate(ts)})
        out = torch.stack(ts)

        def guard(g, stamps=stamps):
            check_stamps("moe_experts", stamps)
            return g

        out.register_hook(guard)
        stacks[field] = out
    return grouped_weight(model, stacks, linears)


def moe_forward(spec: MoESpec, layer_index: int, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor,
                batch: FlatBatch, store: StateStore, ctx: LayerContext) -> torch.Tensor:
    """``[T, D] -> [T, D]``: ``round(sum_k w_k expert_k(x) + shared(x))`` (fp32 sum in slot order).

    Route (``ops.moe_route``), then ``ctx.dispatcher.experts`` over ``ctx.shard_plan``
    (:mod:`.expert_parallel`: every expert here at EP = 1), which combines in slot order."""
    p = spec.name
    w_TK, ids_TK = ops.moe_route(x_TD, params[f"{p}.gate.weight"], params[f"{p}.gate.e_score_correction_bias"],
                                 **spec.route_kwargs())
    if taps.SINK is not None: w_TK, ids_TK = taps.SINK(f"{p}.router", w_TK), taps.SINK(f"{p}.router_ids", ids_TK)
    (up, kind), (down, _) = (expert_weights(spec, ctx.model, params, proj) for proj in ("up_proj", "down_proj"))
    nvfp4 = kind == "nvfp4"
    shared_TD = None
    if spec.shared_intermediate_size is not None:
        shared_TD = ops.moe_shared_expert(x_TD, params[f"{p}.shared_experts.up_proj.weight"],
                                          params[f"{p}.shared_experts.down_proj.weight"])
        if taps.SINK is not None: shared_TD = taps.SINK(f"{p}.shared_experts", shared_TD)
    y_TD = ctx.dispatcher.experts(ctx.shard_plan, x_TD, ids_TK, w_TK, up, down, shared_TD, nvfp4=nvfp4,
                                  out_dtype=x_TD.dtype)
    if taps.SINK is not None: y_TD = taps.SINK(f"{p}.experts", y_TD)
    return y_TD


def _expert_stack_oracle(m: MoESpec, params: Mapping[str, torch.Tensor], proj: str) -> torch.Tensor:
    return torch.stack([params[m.expert_weight_name(e, proj)] for e in range(m.n_routed_experts)])


def moe_oracle(m: MoESpec, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor) -> torch.Tensor:
    """Router, experts and shared expert with the ops' fp64 oracles, in ``x_TD.dtype``;
    quantized experts come fake-quantized in ``params`` (the reference model's view)."""
    wts, ids = moe_route_reference(x_TD, params[m.name + ".gate.weight"],
                                   params[m.name + ".gate.e_score_correction_bias"], **m.route_kwargs())
    shared = None
    if m.shared_intermediate_size is not None:
        shared = moe_shared_expert_reference(x_TD, params[m.name + ".shared_experts.up_proj.weight"],
                                             params[m.name + ".shared_experts.down_proj.weight"])
    y = moe_experts_reference(x_TD, ids, wts, _expert_stack_oracle(m, params, "up_proj"),
                              _expert_stack_oracle(m, params, "down_proj"), shared)
    return y.to(x_TD.dtype)


def moe_near_ties(m: MoESpec, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor,
                  engine_dtype: torch.dtype) -> torch.Tensor:
    """bool ``[T]``: the tokens whose routing (the group choice, then the top-k experts of the kept
    groups: :func:`~unified_models.ops.moe.moe_route_reference`'s selection scores, sigmoid plus the
    correction bias) is decided by scores within the rounding of the engine's fp32 scores
    (:func:`.oracle.topk_near_ties`)."""
    from .oracle import near_tie_margin, topk_near_ties

    del engine_dtype  # the engine's router scores are fp32 whatever the model dtype
    margin = near_tie_margin(torch.float32)
    logits = x_TD @ params[m.name + ".gate.weight"].to(x_TD.dtype).t()
    c = torch.sigmoid(logits) + params[m.name + ".gate.e_score_correction_bias"].to(x_TD.dtype)
    t, e = c.shape
    near = torch.zeros(t, dtype=torch.bool, device=x_TD.device)
    if m.n_group > 1:
        per = e // m.n_group
        gs = c.view(t, m.n_group, per).topk(2, dim=-1).values.sum(-1)
        near |= topk_near_ties(gs, m.topk_group, margin)
        keep = gs.topk(m.topk_group, dim=-1).indices
        mask = torch.zeros(t, m.n_group, dtype=torch.bool, device=c.device).scatter_(1, keep, True)
        c = c.masked_fill(~mask.repeat_interleave(per, dim=1), float("-inf"))
    return near | topk_near_ties(c, m.top_k, margin)


def moe_init_rules(m: MoESpec) -> dict:
    """The router's correction bias starts at 0."""
    return {f"{m.name}.gate.e_score_correction_bias": lambda p: p.zero_()}


def moe_megatron_fields(e: MoESpec) -> dict:
    """Megatron's MoE sizes and router (sigmoid scoring, routed scaling, group-limited top-k)."""
    out = dict(ffn_hidden_size=e.intermediate_size, num_moe_experts=e.n_routed_experts, moe_router_topk=e.top_k,
               moe_ffn_hidden_size=e.intermediate_size, moe_router_score_function="sigmoid",
               moe_router_topk_scaling_factor=e.routed_scaling_factor)
    if e.shared_intermediate_size is not None:
        out["moe_shared_expert_intermediate_size"] = e.shared_intermediate_size
    if e.n_group > 1:
        out.update(moe_router_num_groups=e.n_group, moe_router_group_topk=e.topk_group)
    return out


def moe_stacked_parameters(m: MoESpec) -> tuple[tuple[str, ...], ...]:
    """One group of linears per projection: the routed experts', expert 0 first (stacked
    field by field, whatever their weight format)."""
    return tuple(tuple(m.expert_linear(e, proj) for e in range(m.n_routed_experts)) for proj in ("up_proj", "down_proj"))


# ----------------------------------------------------------------------------- quantization (NVFP4 experts)

def moe_linears(m: MoESpec) -> dict[str, str]:
    """Every routed expert's ``up_proj`` / ``down_proj``: export role ``"experts"``."""
    return {m.expert_linear(e, proj): "experts" for e in range(m.n_routed_experts) for proj in ("up_proj", "down_proj")}


def moe_check_formats(m: MoESpec, weight_format) -> None:
    """Every routed expert of the layer in one format with a grouped kernel (NVFP4), or none;
    the router and the shared expert stay model-dtype."""
    fmts = {weight_format(n) for n in moe_linears(m)}
    if len(fmts) != 1:
        raise SpecError(f"{m.name}: routed experts in formats {sorted(str(f) for f in fmts)}; every expert of a "
                        "layer must have the same format (or none)")
    fmt = next(iter(fmts))
    if fmt is not None and fmt.format != "nvfp4":
        raise SpecError(f"{m.name}: routed experts in weight format {fmt.format!r}; the experts kernels take "
                        "model-dtype or 'nvfp4' weights")
    for n in (f"{m.name}.gate", f"{m.name}.shared_experts.up_proj", f"{m.name}.shared_experts.down_proj"):
        if weight_format(n) is not None:
            raise SpecError(f"{n}: a weight format on the router or the shared expert is not supported")


QUANTIZATION = QuantizationRules(linears=moe_linears, check_formats=moe_check_formats)

FAMILY = LayerFamily(spec_type=MoESpec, forward=moe_forward, oracle=moe_oracle, oracle_near_ties=moe_near_ties,
                     init_rules=moe_init_rules,
                     megatron_fields=moe_megatron_fields, stacked_parameters=moe_stacked_parameters,
                     frozen_views=moe_frozen_views, quantization=QUANTIZATION)
