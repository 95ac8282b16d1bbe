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

import dataclasses
from typing import Mapping

import torch

from .. import ops
from ..dsl import MoESpec
from ..ops.moe import moe_experts_reference, moe_route_reference, moe_shared_expert_reference
from ..state import FlatBatch, StateStore
from .common import LayerContext
from .family import LayerFamily
from .quantization import QuantizationOptions, QuantizationRules


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


def _expert_stack_oracle(m: MoESpec, params: Mapping[str, torch.Tensor], proj: str) -> torch.Tensor:
    w = torch.stack([params[m.expert_weight_name(e, proj)] for e in range(m.n_routed_experts)])
    if m.quantization == "nvfp4":  # dequantized by ModelOpt's rule, straight-through to the masters
        wq = ops.nvfp4_dequantize(ops.nvfp4_quantize(w.detach().float()), torch.float32).to(w.dtype)
        w = w + (wq - w).detach()
    return w


def moe_oracle(m: MoESpec, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor) -> torch.Tensor:
    """Router, experts and shared expert with the ops' fp64 oracles, in ``x_TD.dtype``;
    NVFP4 experts compute with the dequantized weights (ModelOpt's rule)."""
    wts, ids = moe_route_reference(x_TD, params[m.name + ".gate.weight"],
                                   params[m.name + ".gate.e_score_correction_bias"], **m.route_kwargs())
    shared = None
    if m.shared_intermediate_size is not None:
        shared = moe_shared_expert_reference(x_TD, params[m.name + ".shared_experts.up_proj.weight"],
                                             params[m.name + ".shared_experts.down_proj.weight"])
    y = moe_experts_reference(x_TD, ids, wts, _expert_stack_oracle(m, params, "up_proj"),
                              _expert_stack_oracle(m, params, "down_proj"), shared)
    return y.to(x_TD.dtype)


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
    """One group per projection and stored field (``weight``, NVFP4 ``weight_scale``, ...):
    the routed experts' tensors, expert 0 first."""
    groups = []
    for proj in ("up_proj", "down_proj"):
        for field in m.expert_proj_shapes(proj):
            groups.append(tuple(m.expert_tensor_names(e, proj)[field] for e in range(m.n_routed_experts)))
    return tuple(groups)


# ----------------------------------------------------------------------------- ModelOpt quantization (NVFP4 experts)

def moe_to_master(m: MoESpec) -> MoESpec:
    """Stored NVFP4 codes -> bf16 masters (``checkpoint_format "master"``, no ``input_scale``)."""
    if m.checkpoint_format != "modelopt":
        return m
    return dataclasses.replace(m, checkpoint_format="master", expert_input_scale=False)


def moe_dequantized(m: MoESpec) -> MoESpec:
    """bf16 experts."""
    if m.quantization != "bf16":
        return dataclasses.replace(m, quantization="bf16")
    return m


def moe_quantized(m: MoESpec, options: QuantizationOptions) -> MoESpec:
    """NVFP4 (W4A16) experts in ModelOpt's stored format when ``options.experts``."""
    if options.experts:
        return dataclasses.replace(m, quantization="nvfp4", checkpoint_format="modelopt")
    return m


def moe_dequantize_tensors(m: MoESpec, state: Mapping[str, torch.Tensor], out: dict[str, torch.Tensor],
                           dtype: torch.dtype) -> None:
    """Each expert's NVFP4 ``weight`` dequantized by ModelOpt's rule (``ops.nvfp4_dequantize``);
    its ``weight_scale``, ``weight_scale_2`` and ``input_scale`` dropped."""
    from ..ops.nvfp4 import NVFP4Weight, nvfp4_dequantize

    if not m.packed:
        return
    for e in range(m.n_routed_experts):
        for proj in ("up_proj", "down_proj"):
            names = m.expert_tensor_names(e, proj)
            q = NVFP4Weight(state[names["weight"]], state[names["weight_scale"]],
                            state[names["weight_scale_2"]].reshape(()))
            for f, n in names.items():
                out.pop(n, None)
            out[names["weight"]] = nvfp4_dequantize(q, dtype)


def moe_quantize_tensors(m: MoESpec, masters: Mapping[str, torch.Tensor], wanted: set[str],
                         out: dict[str, torch.Tensor]) -> set[str]:
    """``ops.nvfp4_quantize`` per expert (each expert its own ``weight_scale_2``)."""
    from ..ops.nvfp4 import nvfp4_quantize

    derived: set[str] = set()
    if not m.packed:
        return derived
    for e in range(m.n_routed_experts):
        for proj in ("up_proj", "down_proj"):
            names = m.expert_tensor_names(e, proj)
            derived.add(names["weight"])
            if names["weight"] not in wanted:
                continue
            q = nvfp4_quantize(masters[names["weight"]])
            out[names["weight"]] = q.weight
            out[names["weight_scale"]] = q.weight_scale
            out[names["weight_scale_2"]] = q.weight_scale_2.reshape(())
            # an NVFP4 W4A4 export's input_scale is calibrated, not derived: not written here
    return derived


def moe_quantized_layers(m: MoESpec) -> dict[str, dict]:
    """One ``NVFP4`` / ``W4A16_NVFP4`` entry (``group_size`` 16) per expert projection."""
    layers: dict[str, dict] = {}
    if m.quantization == "nvfp4":
        algo = "NVFP4" if m.expert_input_scale else "W4A16_NVFP4"
        for e in range(m.n_routed_experts):
            for proj in ("up_proj", "down_proj"):
                layers[f"{m.name}.experts.{e}.{proj}"] = {"quant_algo": algo, "group_size": 16}
    return layers


def moe_validate_quantized(m: MoESpec, layer_index: int, state: Mapping[str, torch.Tensor]) -> list[str]:
    """The stored NVFP4 experts (``ops.nvfp4.validate_nvfp4_experts``)."""
    from ..ops.nvfp4 import NVFP4Error, validate_nvfp4_experts

    if not m.packed:
        return []
    experts = {e: {proj: {f: state.get(n) for f, n in m.expert_tensor_names(e, proj).items()}
                   for proj in ("up_proj", "down_proj")} for e in range(m.n_routed_experts)}
    shapes = {"up_proj": (m.intermediate_size, m.hidden_size), "down_proj": (m.hidden_size, m.intermediate_size)}
    try:
        validate_nvfp4_experts(layer_index, experts, num_experts=m.n_routed_experts, shapes=shapes,
                               require_input_scale=m.expert_input_scale)
    except NVFP4Error as e:
        return [str(e)]
    return []


QUANTIZATION = QuantizationRules(to_master=moe_to_master, dequantized=moe_dequantized, quantized=moe_quantized,
                                 dequantize_tensors=moe_dequantize_tensors, quantize_tensors=moe_quantize_tensors,
                                 quantized_layers=moe_quantized_layers, validate=moe_validate_quantized)

FAMILY = LayerFamily(spec_type=MoESpec, forward=moe_forward, oracle=moe_oracle, init_rules=moe_init_rules,
                     megatron_fields=moe_megatron_fields, stacked_parameters=moe_stacked_parameters,
                     quantization=QUANTIZATION)
