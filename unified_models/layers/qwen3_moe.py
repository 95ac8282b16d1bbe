"""Forward of :class:`~unified_models.dsl.Qwen3MoESpec`: softmax router, SwiGLU experts (stateless).

``ops.softmax_route`` (one fp32 router GEMM, logits rounded to the model dtype as transformers and
vLLM do, fp32 softmax, total-order top-k) -> ``ctx.dispatcher.swiglu_experts`` with
``weight_before_down=False`` and no clamp (``swiglu_limit=inf``): per assignment
``y = fp32(round_x(silu(g) * u) down_e^T)``, combined as ``round(sum_k w_k y_k)`` in fp32 slot order.
Expert weights are stacked as the other MoE layers do (:func:`.moe.expert_weights`: a view when
they are evenly spaced views of one buffer, else ``torch.stack`` with the weight-version guard).

Shapes: T tokens, D hidden, E experts, K top-k, I expert width.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

from .. import ops
from ..dsl import ParallelismError
from ..dsl.qwen3_moe import EXPERT_PROJS, Qwen3MoESpec
from ..ops.moe import softmax_route_reference, swiglu_experts_reference
from ..porting import taps
from ..state import FlatBatch, StateStore
from .common import LayerContext
from .family import LayerFamily
from .moe import expert_frozen_views, expert_weights


def qwen3_moe_forward(spec: Qwen3MoESpec, layer_index: int, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor,
                      batch: FlatBatch, store: StateStore, ctx: LayerContext) -> torch.Tensor:
    """``[T, D] -> [T, D]``: ``round(sum_k w_k down_e(silu(gate_e x) * up_e x))`` (fp32 sum in slot order)."""
    p = spec.name
    w_TK, ids_TK = ops.softmax_route(x_TD, params[f"{p}.gate.weight"], top_k=spec.top_k,
                                     norm_topk_prob=spec.norm_topk_prob, logits_dtype=x_TD.dtype)
    if taps.SINK is not None: w_TK, ids_TK = taps.SINK(f"{p}.router", w_TK), taps.SINK(f"{p}.router_ids", ids_TK)
    stacks = [expert_weights(spec, ctx.model, params, proj)[0] for proj in EXPERT_PROJS]
    run = getattr(ctx.dispatcher, "swiglu_experts", None)
    if run is None:
        raise ParallelismError(f"{p}: the expert dispatcher {type(ctx.dispatcher).__name__} has no swiglu_experts "
                               "(SwiGLU experts; layers/expert_parallel.py)")
    y_TD = run(ctx.shard_plan, x_TD, ids_TK, w_TK, *stacks, None, swiglu_limit=math.inf, out_dtype=x_TD.dtype,
               weight_before_down=False)
    if taps.SINK is not None: y_TD = taps.SINK(f"{p}.experts", y_TD)
    return y_TD


def qwen3_moe_oracle(m: Qwen3MoESpec, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor) -> torch.Tensor:
    """Router and experts with the ops' fp64 oracles, in ``x_TD.dtype`` (no rounding of the logits)."""
    wts, ids = softmax_route_reference(x_TD, params[f"{m.name}.gate.weight"], top_k=m.top_k,
                                       norm_topk_prob=m.norm_topk_prob)
    stacks = [torch.stack([params[f"{m.expert_linear(e, j)}.weight"] for e in range(m.n_routed_experts)])
              for j in EXPERT_PROJS]
    return swiglu_experts_reference(x_TD, ids, wts, *stacks, None, swiglu_limit=math.inf).to(x_TD.dtype)


def qwen3_moe_near_ties(m: Qwen3MoESpec, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor,
                        engine_dtype: torch.dtype) -> torch.Tensor:
    """bool ``[T]``: the tokens whose top-k experts (the router logits' order, which the softmax keeps:
    :func:`~unified_models.ops.moe.softmax_route_reference`) are decided by logits within the rounding
    of the engine's: its router logits are rounded to the model dtype (``logits_dtype=x_TD.dtype`` in
    :func:`qwen3_moe_forward`, as transformers' ``Qwen3MoeSparseMoeBlock`` does), so ``engine_dtype``'s
    margin (:func:`.oracle.topk_near_ties`)."""
    from .oracle import near_tie_margin, topk_near_ties

    margin = near_tie_margin(engine_dtype)
    return topk_near_ties(x_TD @ params[f"{m.name}.gate.weight"].to(x_TD.dtype).t(), m.top_k, margin)


def qwen3_moe_frozen_views(spec: Qwen3MoESpec, model, params: Mapping[str, torch.Tensor]) -> dict:
    """The routed experts' ``(weight, kind)`` per projection when each is a view of one buffer."""
    return expert_frozen_views(spec, model, params, EXPERT_PROJS)


def qwen3_moe_megatron_fields(m: Qwen3MoESpec) -> dict:
    """Megatron's MoE sizes (softmax scoring; our forward routes)."""
    i = m.moe_intermediate_size
    return dict(num_moe_experts=m.n_routed_experts, moe_router_topk=m.top_k, moe_ffn_hidden_size=i,
                moe_router_score_function="softmax")


def qwen3_moe_stacked_parameters(m: Qwen3MoESpec) -> tuple[tuple[str, ...], ...]:
    """One group per projection (gate, up, down): the routed experts', expert 0 first."""
    return tuple(tuple(m.expert_linear(e, proj) for e in range(m.n_routed_experts)) for proj in EXPERT_PROJS)


FAMILY = LayerFamily(spec_type=Qwen3MoESpec, forward=qwen3_moe_forward, oracle=qwen3_moe_oracle,
                     oracle_near_ties=qwen3_moe_near_ties,
                     megatron_fields=qwen3_moe_megatron_fields, stacked_parameters=qwen3_moe_stacked_parameters,
                     frozen_views=qwen3_moe_frozen_views)
