"""Parameter storage of a spec, shared by every engine: dtypes and the stacked groups (routed experts).

Both engines (and the reference) allocate their parameters here, so names,
shapes and stored dtypes (:meth:`ModelSpec.parameter_dtypes`) cannot drift.
Routed experts are allocated as views of one ``[E, ...]`` buffer per layer,
projection and stored field (``weight``, NVFP4 ``weight_scale``, ...): each
expert keeps its own HF-named tensor (its own parameter and ``.grad``), while
the MoE layer hands the kernel the whole stack without a copy
(:func:`unified_models.layers.moe.expert_weights`).
"""

from __future__ import annotations

import torch

from .dsl import ModelSpec


def stacked_views(spec: ModelSpec, device: torch.device | str | None,
                  dtypes: dict[str, torch.dtype] | None = None, plan=None) -> dict[str, torch.Tensor]:
    """HF name -> ``buf[j]`` view for every tensor of a family's stacked group of linears
    (:attr:`unified_models.layers.LayerFamily.stacked_parameters`: one ``[len(group), ...]``
    buffer per group and tensor field of the linears' weight format; routed experts: one per
    projection and stored field, e.g. ``weight``, NVFP4 ``weight_scale``).

    Args:
        spec: the model spec.
        device: where the buffers live (None: torch's current default device, e.g.
            the one vLLM sets while it builds the model).
        dtypes: stored dtype per name (default :meth:`ModelSpec.parameter_dtypes`).
        plan: expert parallelism (:class:`~unified_models.layers.expert_parallel.ShardPlan`;
            ``None`` = EP 1): each group holds only this rank's contiguous block
            ``plan.local_experts(len(group))``, views of one ``[len(group) / EP, ...]`` buffer.

    Returns:
        Uninitialised views; names outside every group (and, at EP > 1, the members other
        ranks hold) are absent.

    Raises:
        SpecError: a group mixes shapes or dtypes.
        ParallelismError: ``plan.ep_size`` does not divide a group's size.
    """
    from .dsl import SpecError
    from .layers import family_of
    from .layers.weight_formats import linear_fields

    dtypes = dtypes if dtypes is not None else spec.parameter_dtypes()
    shapes = spec.parameter_shapes()
    views: dict[str, torch.Tensor] = {}
    for sub in spec.sublayers:
        for linears in family_of(sub.mixer, sub.index).stacked_parameters(sub.mixer):
            for field in linear_fields(spec.weight_format(linears[0])):
                group = tuple(f"{n}.{field}" for n in linears)
                if any(n not in shapes for n in group):
                    raise SpecError(f"stacked linears {linears[0]}...: not all have a {field!r} tensor "
                                    "(mixed weight formats?)")
                shape, dtype = shapes[group[0]], dtypes[group[0]]
                if any(shapes[n] != shape or dtypes[n] != dtype for n in group):
                    raise SpecError(f"stacked parameters {group[0]}...: members differ in shape or dtype")
                mine = range(len(group)) if plan is None or plan.ep_size == 1 else plan.local_experts(len(group))
                buf = torch.empty((len(mine), *shape), dtype=dtype, device=device)
                for i, j in enumerate(mine):
                    views[group[j]] = buf[i]
    return views


def allocate_parameters(spec: ModelSpec, device: torch.device | str | None = None, plan=None
                        ) -> dict[str, torch.Tensor]:
    """Every parameter of ``spec`` (HF name -> uninitialised tensor of its stored dtype), in model order.

    Stacked groups (routed experts) are views of one buffer each (:func:`stacked_views`).
    With an expert-parallel ``plan`` (:class:`~unified_models.layers.expert_parallel.ShardPlan`,
    EP > 1) the routed experts other ranks hold are left out; this rank's keep their global
    HF names (``...experts.<global e>...``).

    Raises:
        ParallelismError: ``plan.ep_size`` does not divide a MoE layer's expert count.
    """
    dtypes = spec.parameter_dtypes()
    views = stacked_views(spec, device, dtypes, plan)
    foreign: set[str] = set()
    if plan is not None and plan.ep_size > 1:
        from .layers.expert_shards import foreign_expert_shapes

        foreign = set(foreign_expert_shapes(spec, plan))
    out = {}
    for name, shape in spec.parameter_shapes().items():
        if name in foreign:
            continue
        t = views.get(name)
        out[name] = t if t is not None else torch.empty(shape, dtype=dtypes[name], device=device)
    return out


def is_trainable(dtype: torch.dtype) -> bool:
    """Whether a stored tensor of ``dtype`` can be a trained master (floating, not an fp8 code)."""
    return dtype.is_floating_point and dtype not in (torch.float8_e4m3fn, torch.float8_e5m2)
