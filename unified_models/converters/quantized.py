"""Load-time validation of a checkpoint's quantized tensors in NVIDIA ModelOpt's format
(NVFP4 experts, FP8 Mamba projections, FP8 KV-cache scales; the format:
:mod:`unified_models.converters.modelopt`). Used by the safetensors reader
(:func:`~unified_models.converters.hf_safetensors.validate_state_dict`), the ModelOpt
exporter and the engines' loaders.
"""

from __future__ import annotations

from typing import Mapping

import torch

from ..dsl import AttentionSpec, CheckpointError, Mamba2Spec, ModelSpec, MoESpec


def _scalar_problems(name: str, t: torch.Tensor | None) -> list[str]:
    from ..ops.scales import scalar_scale_problems

    return scalar_scale_problems(name, t, required=True)


def validate_quantized(state: Mapping[str, torch.Tensor], spec: ModelSpec, *, source: str) -> None:
    """Check every quantized tensor of ``state`` against ``spec``: NVFP4 experts, FP8 Mamba projections,
    FP8 KV scales.

    Raises:
        CheckpointError: one message listing every bad tensor: missing, zero,
            negative, NaN or Inf scales (the NVFP4 part names the layer and the
            expert ids, e.g. ``layer 3: bad expert ids [5]: expert 5 up_proj:
            weight_scale_2 is zero``), NaN e4m3 codes.
    """
    from ..ops.nvfp4 import NVFP4Error, validate_nvfp4_experts

    problems: list[str] = []
    for blk in spec.sublayers:
        m = blk.mixer
        if isinstance(m, MoESpec) and m.packed:
            experts = {e: {proj: {f: state.get(n) for f, n in m.expert_tensor_names(e, proj).items()}
                           for proj in ("up_proj", "down_proj")} for e in range(m.n_routed_experts)}
            shapes = {"up_proj": (m.intermediate_size, m.hidden_size), "down_proj": (m.hidden_size, m.intermediate_size)}
            try:
                validate_nvfp4_experts(blk.index, experts, num_experts=m.n_routed_experts, shapes=shapes,
                                       require_input_scale=m.expert_input_scale)
            except NVFP4Error as e:
                problems.append(str(e))
        elif isinstance(m, Mamba2Spec) and m.proj_quantization == "fp8":
            for proj in ("in_proj", "out_proj"):
                base = f"{m.name}.{proj}"
                problems += _scalar_problems(f"{base}.input_scale", state.get(f"{base}.input_scale"))
                if m.checkpoint_format == "modelopt":
                    problems += _scalar_problems(f"{base}.weight_scale", state.get(f"{base}.weight_scale"))
                    w = state.get(f"{base}.weight")
                    if w is not None and w.dtype == torch.float8_e4m3fn:
                        nan = int(((w.view(torch.uint8) & 0x7F) == 0x7F).sum())
                        if nan:
                            problems.append(f"{base}.weight holds {nan} NaN e4m3 code(s)")
        elif isinstance(m, AttentionSpec) and getattr(m, "kv_cache_dtype", "auto") != "auto":
            for n in kv_scale_names(m):
                problems += _scalar_problems(n, state.get(n))
    if problems:
        raise CheckpointError(f"checkpoint {source}: bad quantized tensors: " + "; ".join(problems))


def kv_scale_names(spec: AttentionSpec) -> tuple[str, str]:
    """HF names of an FP8-KV attention layer's ``k_scale`` and ``v_scale`` (ModelOpt's export names)."""
    return f"{spec.name}.k_proj.k_scale", f"{spec.name}.v_proj.v_scale"
