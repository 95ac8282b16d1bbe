"""Which routed-expert tensors an expert-parallel rank holds, and the stacks its forward reads.

Engine-neutral (no vLLM, no Megatron import): both the Megatron module
(:mod:`unified_models.backends.megatron.module`, over Megatron's EP group) and the vLLM
model class (:mod:`unified_models.backends.vllm.model`, over vLLM's EP group) hold only
their rank's block of routed experts (:class:`~.expert_parallel.ShardPlan`, Megatron's
contiguous layout) under the experts' **global** Hugging Face names, and hand the MoE
layers ``[E / EP, ...]`` stacks of them (:func:`local_expert_stacks`).

Shapes: E routed experts of a layer, EP the expert-parallel size, L = E / EP local experts.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..dsl import ParallelismError, SpecError
from .expert_parallel import ShardPlan

__all__ = ["expert_groups", "check_expert_layout", "expert_tensor_groups", "foreign_expert_shapes",
           "local_expert_stacks", "with_absent_experts"]


def expert_groups(spec) -> list[tuple[object, tuple[str, ...]]]:
    """``(mixer spec, linear names)`` of every stacked group of routed experts (one per MoE layer and
    projection, expert 0 first: :attr:`unified_models.layers.LayerFamily.stacked_parameters`)."""
    from . import family_of

    return [(sub.mixer, tuple(linears)) for sub in spec.sublayers
            for linears in family_of(sub.mixer, sub.index).stacked_parameters(sub.mixer)]


def check_expert_layout(spec, expert_model_parallel_size: int, *, where: str = "parallel layout") -> None:
    """Refuse an expert-parallel size that cannot shard ``spec``'s routed experts (Megatron's contiguous blocks).

    Raises:
        ParallelismError: EP > 1 for a model without routed experts, or EP not dividing a MoE
            layer's routed-expert count (the layer is named).
    """
    ep = expert_model_parallel_size
    if ep == 1:
        return
    groups = expert_groups(spec)
    if not groups:
        raise ParallelismError(f"{where}: expert_model_parallel_size={ep} but the {spec.family} model has no routed "
                               "experts to shard; use EP=1")
    for mixer, linears in groups:
        if len(linears) % ep:
            raise ParallelismError(
                f"{where}: expert_model_parallel_size={ep} does not divide the {len(linears)} routed experts of "
                f"{mixer.name} (each EP rank holds a contiguous block of E/EP experts); use an EP that divides "
                f"{len(linears)}")


def expert_tensor_groups(spec) -> list[list[str]]:
    """Every routed-expert tensor name, one list per MoE layer, projection and stored field
    (``weight``, NVFP4 ``weight_scale``, ...), expert 0 first."""
    from .weight_formats import linear_fields

    return [[f"{n}.{field}" for n in linears] for _, linears in expert_groups(spec)
            for field in linear_fields(spec.weight_format(linears[0]))]


def foreign_expert_shapes(spec, plan: ShardPlan) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every routed-expert tensor the *other* ranks of ``plan`` hold (empty at EP = 1).

    Raises:
        ParallelismError: ``plan.ep_size`` does not divide a layer's expert count.
    """
    if plan.ep_size == 1:
        return {}
    shapes = spec.parameter_shapes()
    out: dict[str, tuple[int, ...]] = {}
    for names in expert_tensor_groups(spec):
        mine = plan.local_experts(len(names))
        out.update({n: tuple(shapes[n]) for j, n in enumerate(names) if j not in mine})
    return out


def with_absent_experts(spec, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` plus a ``meta`` placeholder (the dtype of a held expert of the same layer, projection
    and field) for every routed-expert tensor this rank does not hold, so an execution-contract
    fingerprint (``consistency.fingerprint.contract_fingerprint``, which records each parameter's
    dtype) is the same at every EP."""
    out = dict(params)
    for names in expert_tensor_groups(spec):
        here = next((out[n] for n in names if n in out), None)
        if here is not None:
            out.update({n: torch.empty(0, dtype=here.dtype, device="meta") for n in names if n not in out})
    return out


def local_expert_stacks(spec, params: Mapping[str, torch.Tensor], plan: ShardPlan) -> dict[str, Any]:
    """The MoE layers' ready-made expert weights over this rank's experts only
    (``layers.moe.expert_stack_key`` -> ``(weight, kind)``, which :func:`.moe.expert_weights`
    takes instead of stacking all ``E``): ``[L, ...]`` views of the local buffer, or with
    gradients a ``torch.stack`` guarded by the experts' weight-version stamps (as
    ``expert_weights`` does at EP = 1).

    Raises:
        SpecError: a family's expert linears are not named ``<mixer>.experts.<e>.<proj>``.
    """
    from .moe import _as_stack, expert_stack_key
    from .weight_formats import grouped_weight, linear_fields

    out: dict[str, Any] = {}
    for mixer, linears in expert_groups(spec):
        mine = [linears[j] for j in plan.local_experts(len(linears))]
        proj = linears[0].rsplit(".", 1)[1]
        if mixer.expert_linear(0, proj) != linears[0]:
            raise SpecError(f"{linears[0]}: expert parallelism needs expert linears named "
                            f"<mixer>.experts.<e>.<proj> (expert_linear(0, {proj!r}) = {mixer.expert_linear(0, proj)})")
        stacks: dict[str, torch.Tensor] = {}
        for field in linear_fields(spec.weight_format(linears[0])):
            ts = [params[f"{n}.{field}"] for n in mine]
            if field == "weight" and torch.is_grad_enabled() and any(t.requires_grad for t in ts):
                from ..ops.grad.weights import check_stamps, stamp

                stamps = stamp(**{f"expert {n} weight": t for n, t in zip(mine, ts)})
                stack = torch.stack(ts)

                def guard(g, stamps=stamps):
                    check_stamps("moe_experts", stamps)
                    return g

                stack.register_hook(guard)
            else:
                stack = _as_stack(ts)
                stack = stack if stack is not None else torch.stack(ts)
            stacks[field] = stack
        out[expert_stack_key(mixer, proj)] = grouped_weight(spec, stacks, mine)
    return out
