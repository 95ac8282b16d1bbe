"""Parameter storage of a spec, shared by every engine: dtypes and the routed-expert stacks.

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

from .dsl import ModelSpec, MoESpec


def expert_stack_views(spec: ModelSpec, device: torch.device | str | None,
                       dtypes: dict[str, torch.dtype] | None = None) -> dict[str, torch.Tensor]:
    """HF name -> ``buf[e]`` view for every routed expert tensor (one ``[E, ...]`` buffer per field).

    Args:
        spec: the model spec.
        device: where the buffers live (None: torch's current default device, e.g.
            the one vLLM sets while it builds the model).
        dtypes: stored dtype per name (default :meth:`ModelSpec.parameter_dtypes`).

    Returns:
        Uninitialised views; non-expert names are absent.
    """
    dtypes = dtypes if dtypes is not None else spec.parameter_dtypes()
    views: dict[str, torch.Tensor] = {}
    for blk in spec.blocks_of(MoESpec):
        m = blk.mixer
        for proj in ("up_proj", "down_proj"):
            first = m.expert_tensor_names(0, proj)
            for field, shape in m.expert_proj_shapes(proj).items():
                buf = torch.empty((m.n_routed_experts, *shape), dtype=dtypes[first[field]], device=device)
                for e in range(m.n_routed_experts):
                    views[m.expert_tensor_names(e, proj)[field]] = buf[e]
    return views


def allocate_parameters(spec: ModelSpec, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Every parameter of ``spec`` (HF name -> uninitialised tensor of its stored dtype), in model order.

    Routed experts are views of stacked buffers (:func:`expert_stack_views`).
    """
    dtypes = spec.parameter_dtypes()
    views = expert_stack_views(spec, device, dtypes)
    out = {}
    for name, shape in spec.parameter_shapes().items():
        t = views.get(name)
        out[name] = t if t is not None else torch.empty(shape, dtype=dtypes[name], device=device)
    return out


def is_trainable(dtype: torch.dtype) -> bool:
    """Whether a stored tensor of ``dtype`` can be a trained master (floating, not an fp8 code)."""
    return dtype.is_floating_point and dtype not in (torch.float8_e4m3fn, torch.float8_e5m2)
